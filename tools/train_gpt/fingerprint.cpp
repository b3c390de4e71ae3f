#include "fingerprint.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>

namespace train_gpt {
namespace {

int64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return static_cast<int64_t>(h);
}

std::string num(double v) {
  char b[40];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

constexpr int64_t kValueChars = 96;  // values longer than this are compared whole, shown cut
constexpr size_t kShownOptions = 3;  // at most this many differing options get their values shown
constexpr size_t kShownRanks = 6;    // per value

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kShownRanks; ++i) {
    if (i) out += ',';
    out += std::to_string(ranks[i]);
  }
  if (ranks.size() > kShownRanks) out += ",... (" + std::to_string(ranks.size()) + " ranks)";
  return out;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> rank_agreed_options(const Options& o) {
  auto i = [](int64_t v) { return std::to_string(v); };
  return {
      {"--data", o.data},
      {"--val-data", o.val_data},
      {"--vocab-size", i(o.vocab_size)},
      {"--model", o.model},
      {"--init-from", o.init_from},
      {"--layers", i(o.layers)},
      {"--dim", i(o.dim)},
      {"--heads", i(o.heads)},
      {"--kv-heads", i(o.kv_heads)},
      {"--ffn-dim", i(o.ffn_dim)},
      {"--seq-len", i(o.seq_len)},
      {"--batch-size", i(o.batch_size)},
      {"--grad-accum", i(o.grad_accum)},
      {"--steps", i(o.steps)},
      {"--lr", num(o.lr)},
      {"--warmup", i(o.warmup)},
      {"--weight-decay", num(o.weight_decay)},
      {"--optimizer", o.optimizer},
      {"--clip", num(o.clip)},
      {"--seed", std::to_string(o.seed)},
      {"--parallel", o.parallel},
      {"--shard-size", i(o.shard_size)},
      {"--tp-size", i(o.tp_size)},
      {"--ep-size", i(o.ep_size)},
      {"--mixed-precision", o.mixed_precision},
      {"--cpu-offload", o.cpu_offload ? "true" : "false"},
      {"--device", o.device},
      {"--share-gpu", o.share_gpu ? "true" : "false"},
      {"--reshard-after-forward", o.reshard_after_forward},
      {"--checkpoint-dir", o.checkpoint_dir},
      {"--checkpoint-every", i(o.checkpoint_every)},
      {"--resume", o.resume ? "true" : "false"},
      {"--resume-from", o.resume_from},
      {"--keep-checkpoints", i(o.keep_checkpoints)},
      {"--activation-checkpointing", o.activation_checkpointing},
      {"--eval-every", i(o.eval_every)},
      {"--eval-batches", i(o.eval_batches)},
      {"--sample-tokens", i(o.sample_tokens)},
      {"--eval-only", o.eval_only ? "true" : "false"},
      {"--export-hf", o.export_hf},
      {"--export-dtype", o.export_dtype},
  };
}

void check_same_options_on_every_rank(fsdp::comm::Comm& comm, const Options& o) {
  const auto options = rank_agreed_options(o);
  const int64_t k = static_cast<int64_t>(options.size());
  const int world = comm.size();
  if (world <= 1) return;
  at::Tensor mine = at::empty({k}, at::kLong);
  for (int64_t j = 0; j < k; ++j) mine[j] = fnv1a(options[j].first + "=" + options[j].second);
  at::Tensor all = at::empty({world * k}, at::kLong);
  comm.all_gather_into_tensor(all, mine);
  all = all.view({world, k});
  std::vector<int64_t> differing;
  for (int64_t j = 0; j < k; ++j) {
    if (!all.select(1, j).eq(all[0][j]).all().item<bool>()) differing.push_back(j);
  }
  if (differing.empty()) return;

  // The values of the first few differing options, as fixed-size character codes.
  const int64_t shown = static_cast<int64_t>(std::min(differing.size(), kShownOptions));
  at::Tensor text = at::zeros({shown, kValueChars}, at::kLong);
  for (int64_t s = 0; s < shown; ++s) {
    const std::string& v = options[differing[s]].second;
    for (int64_t c = 0; c < kValueChars && c < static_cast<int64_t>(v.size()); ++c)
      text[s][c] = static_cast<unsigned char>(v[c]);
  }
  at::Tensor texts = at::empty({world * shown * kValueChars}, at::kLong);
  comm.all_gather_into_tensor(texts, text.view({-1}));
  texts = texts.view({world, shown, kValueChars});
  auto value_of = [&](int r, int64_t s) {
    std::string v;
    for (int64_t c = 0; c < kValueChars; ++c) {
      const int64_t ch = texts[r][s][c].item<int64_t>();
      if (ch == 0) break;
      v.push_back(static_cast<char>(ch));
    }
    return v;
  };

  std::string msg = "the ranks were started with different options: ";
  for (int64_t s = 0; s < shown; ++s) {
    std::vector<std::pair<std::string, std::vector<int>>> groups;  // value -> ranks, in rank order
    for (int r = 0; r < world; ++r) {
      const std::string v = value_of(r, s);
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == v; });
      if (it == groups.end())
        groups.push_back({v, {r}});
      else
        it->second.push_back(r);
    }
    if (s) msg += "; ";
    msg += options[differing[s]].first + " is ";
    for (size_t g = 0; g < groups.size() && g < kShownRanks; ++g) {
      msg += (g ? (g + 1 == groups.size() ? " and " : ", ") : "") + std::string("'") + groups[g].first + "' on " +
             rank_list(groups[g].second);
    }
  }
  if (differing.size() > static_cast<size_t>(shown)) {
    msg += "; also ";
    for (size_t d = shown; d < differing.size(); ++d)
      msg += (d > static_cast<size_t>(shown) ? ", " : "") + options[differing[d]].first;
  }
  msg += " (every rank must get the same options: check the per-rank environment or wrapper script)";
  throw std::invalid_argument(msg);
}

}  // namespace train_gpt
