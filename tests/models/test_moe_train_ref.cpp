// 5 AdamW steps of Mixtral and Qwen3-MoE against transformers' model trained by PyTorch's
// torch.optim.AdamW in one process: tests/models/fixtures/<name>.adamw.safetensors, made by
// scripts/make-moe-fixtures.py, holds the 5 global batches (8 sequences of 12 tokens), the losses,
// the learning rates, the hyperparameters and every parameter after step 5.
//
// The reference trains as data parallelism at 4 ranks of 2 sequences does: each rank's loss is
// transformers' (cross-entropy + router_aux_loss_coef x the load-balancing loss over that rank's
// own tokens, output_router_logits=True), the gradient is the ranks' mean. lr 3e-3 with a linear
// warmup over 2 steps then constant, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on every
// parameter (all read from the file, so both sides state them once).
//   - EP 2 x FSDP 2 at 4 ranks, mesh {dp 2, ep 2} (moe_fixture.h's load_ep_fsdp): rank r trains on
//     rows [2r, 2r + 2) of each batch with torch::optim::AdamW;
//   - a world of one: the unsharded model, the 4 ranks' rows as 4 backward passes of loss / 4.
// Each step's loss (the ranks' mean, all-reduced) equals the reference's within 1e-5 relative, each
// rank's own loss too, and every final parameter (each rank its shard, against the same rows of
// transformers' tensor) within 1e-5 of that tensor's largest magnitude.
//
// Why float32 and these hyperparameters: AdamW's first steps move a parameter by about lr x
// sign(gradient) wherever |gradient| >> eps, so float rounding of a gradient matters only where it
// is near eps or changes sign. With eps 1e-8 transformers' own float32 training is within 4.8e-6 of
// each tensor's max of its float64 training (printed by the fixture script); a larger eps (1e-6)
// makes it worse (2.4e-5 to 7e-5: gradients near eps follow their rounding), and so does lr 1e-2
// (3e-5: routing moves more). The parameters move by up to 2e-2 of a tensor's max, 2000 x the
// tolerance, so the comparison can fail.
#include <gtest/gtest.h>

#include <map>

#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/fsdp.h"
#include "models/moe/hf_moe.h"
#include "moe_fixture.h"
#include "multiprocess.h"
#include "test_helpers.h"

using namespace fsdp::testing;
using namespace fsdp::testing::moe_fixture;
using fsdp::models::MoECausalLM;

namespace {

const std::vector<std::string> kTrained = {"mixtral_untied_sharded", "qwen3_moe_sparse_step"};
constexpr double kTolerance = 1e-5;

struct AdamWReference {
  at::Tensor tokens;  // I64 [steps, ranks x rows, T]
  at::Tensor losses;  // F64 [steps, ranks]
  std::vector<double> lr;
  torch::optim::AdamWOptions options{0.0};
  int64_t ranks = 0, rows = 0;
  std::map<std::string, at::Tensor> final;  // the Hub's names
  int64_t steps() const { return tokens.size(0); }
  at::Tensor rank_rows(int64_t step, int64_t rank) const { return tokens[step].narrow(0, rank * rows, rows); }
  double step_loss(int64_t step) const { return losses[step].mean().item<double>(); }
};

AdamWReference adamw_reference(const std::string& name) {
  fsdp::safetensors::Reader r(std::string(FSDP_HF_FIXTURES) + "/" + name + ".adamw.safetensors");
  AdamWReference ref;
  ref.tokens = r.read("tokens");
  ref.losses = r.read("losses");
  const auto lr = r.read("lr").contiguous();
  ref.lr.assign(lr.data_ptr<double>(), lr.data_ptr<double>() + lr.numel());
  // lr, warmup, beta1, beta2, eps, weight_decay, ranks, rows
  const auto h = r.read("hyper").contiguous();
  const double* v = h.data_ptr<double>();
  ref.options = torch::optim::AdamWOptions(v[0]).betas({v[2], v[3]}).eps(v[4]).weight_decay(v[5]);
  ref.ranks = static_cast<int64_t>(v[6]);
  ref.rows = static_cast<int64_t>(v[7]);
  for (const auto& t : r.header().tensors)
    if (t.name.rfind("final.", 0) == 0) ref.final[t.name.substr(6)] = r.read(t.name);
  TORCH_CHECK(ref.steps() == 5 && static_cast<int64_t>(ref.lr.size()) == ref.steps() && !ref.final.empty(), name,
              ": unexpected reference file");
  return ref;
}

void set_lr(torch::optim::AdamW& opt, double lr) {
  for (auto& group : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
}

struct ParamDiff {
  double worst = 0.0;  // max |ours - transformers'| / max |transformers' tensor|
  std::string where;
  int64_t elements = 0;  // elements compared
  int64_t tensors = 0;
};

// Each parameter of `model` (a shard, or the whole tensor unsharded) against the same rows of the
// reference's final tensor, relative to that whole tensor's largest magnitude.
ParamDiff param_diff(MoECausalLM& model, const AdamWReference& ref) {
  ParamDiff d;
  for (const auto& item : model->named_parameters()) {
    const auto it = ref.final.find(item.key());
    TORCH_CHECK(it != ref.final.end(), item.key(), " is not in transformers' parameters");
    const at::Tensor& full = it->second;
    const at::Tensor ours = item.value().detach();
    auto info = fsdp::shard_info(item.value());
    const at::Tensor theirs = info ? full.narrow(info->shard_dim, info->dim0_offset, info->local_rows) : full;
    TORCH_CHECK(theirs.sizes() == ours.sizes(), item.key(), ": shape ", ours.sizes(), " vs ", theirs.sizes());
    ++d.tensors;
    if (ours.numel() == 0) continue;
    d.elements += ours.numel();
    const double diff = (ours - theirs).abs().max().item<double>() / full.abs().max().item<double>();
    if (diff > d.worst) d.worst = diff, d.where = item.key();
  }
  return d;
}

int64_t total_elements(const AdamWReference& ref) {
  int64_t n = 0;
  for (const auto& [name, t] : ref.final) n += t.numel();
  return n;
}

double all_reduce(double x, fsdp::comm::ReduceOp op) {
  auto t = torch::tensor({x}, at::kDouble);
  fsdp::dist::world_comm()->all_reduce(t, op);
  return t.item<double>();
}

}  // namespace

// ---- EP 2 x FSDP 2 at 4 ranks -----------------------------------------------------------------

FSDP_RANK_WORKER(moe_adamw_ep2_fsdp2_vs_transformers) {
  auto mesh = fsdp::init_device_mesh({2, 2}, {"dp", "ep"});
  const int rank = fsdp::dist::rank();
  for (const auto& name : kTrained) {
    const auto ref = adamw_reference(name);
    TORCH_CHECK(ref.ranks == fsdp::dist::world_size(), name, ": the reference is for ", ref.ranks, " ranks");
    auto model = load_ep_fsdp(fixture(name), mesh);
    torch::optim::AdamW opt(model->parameters(), ref.options);
    double loss_diff = 0.0, own_diff = 0.0;
    std::vector<double> losses;
    for (int64_t s = 0; s < ref.steps(); ++s) {
      set_lr(opt, ref.lr[s]);
      opt.zero_grad();
      const auto rows = ref.rank_rows(s, rank);
      auto loss = shifted_loss(model, fsdp::call(model, rows), rows);
      loss.backward();
      opt.step();
      const double own = loss.item<double>(), theirs_own = ref.losses[s][rank].item<double>();
      own_diff = std::max(own_diff, std::abs(own - theirs_own) / std::abs(theirs_own));
      losses.push_back(all_reduce(own, fsdp::comm::ReduceOp::Sum) / ref.ranks);
      loss_diff = std::max(loss_diff, std::abs(losses.back() - ref.step_loss(s)) / std::abs(ref.step_loss(s)));
    }
    const ParamDiff p = param_diff(model, ref);
    const double worst = all_reduce(p.worst, fsdp::comm::ReduceOp::Max);
    const double own_worst = all_reduce(own_diff, fsdp::comm::ReduceOp::Max);
    const int64_t covered =
        static_cast<int64_t>(all_reduce(static_cast<double>(p.elements), fsdp::comm::ReduceOp::Sum));
    std::printf(
        "%-24s rank %d: EP 2 x FSDP 2 vs transformers + torch.optim.AdamW: worst parameter %.3g of its "
        "tensor's max here (%s, %lld tensors)\n",
        name.c_str(), rank, p.worst, p.where.c_str(), static_cast<long long>(p.tensors));
    if (rank == 0)
      std::printf(
          "%-24s losses ours %.7f %.7f %.7f %.7f %.7f, transformers %.7f %.7f %.7f %.7f %.7f; "
          "max relative loss difference %.3g (each rank's own %.3g); final parameters %.3g of their "
          "tensor's max over all ranks\n",
          name.c_str(), losses[0], losses[1], losses[2], losses[3], losses[4], ref.step_loss(0), ref.step_loss(1),
          ref.step_loss(2), ref.step_loss(3), ref.step_loss(4), loss_diff, own_worst, worst);
    TORCH_CHECK(covered == total_elements(ref), name, ": the ranks compared ", covered, " elements of ",
                total_elements(ref));
    TORCH_CHECK(loss_diff <= kTolerance && own_worst <= kTolerance, name, ": losses differ by ", loss_diff,
                " (each rank's own: ", own_worst, ")");
    TORCH_CHECK(worst <= kTolerance, name, ": final parameters differ by ", worst, " of their tensor's max (here ",
                p.worst, " at ", p.where, ")");
  }
}

TEST(MoETrainRef, AdamWAtEP2FSDP2EqualsTransformers) {
  auto result = run_ranks(4, "moe_adamw_ep2_fsdp2_vs_transformers");
  EXPECT_TRUE(result.all_ok()) << result.report();
  for (const auto& rank : result.ranks) std::printf("%s", rank.output.c_str());  // the measured figures
}

// ---- a world of one ---------------------------------------------------------------------------

TEST(MoETrainRef, AdamWInOneProcessEqualsTransformers) {
  for (const auto& name : kTrained) {
    const auto ref = adamw_reference(name);
    auto model = load_unsharded(fixture(name));
    // The comparison can fail: the parameters move far more than the tolerance.
    const double moved = param_diff(model, ref).worst;
    torch::optim::AdamW opt(model->parameters(), ref.options);
    std::vector<double> losses;
    double loss_diff = 0.0;
    for (int64_t s = 0; s < ref.steps(); ++s) {
      set_lr(opt, ref.lr[s]);
      opt.zero_grad();
      double sum = 0.0;
      for (int64_t r = 0; r < ref.ranks; ++r) {  // the ranks' rows, one backward each: the mean gradient
        const auto rows = ref.rank_rows(s, r);
        auto loss = shifted_loss(model, fsdp::call(model, rows), rows);
        (loss / static_cast<double>(ref.ranks)).backward();
        sum += loss.item<double>();
      }
      opt.step();
      losses.push_back(sum / static_cast<double>(ref.ranks));
      loss_diff = std::max(loss_diff, std::abs(losses.back() - ref.step_loss(s)) / std::abs(ref.step_loss(s)));
    }
    const ParamDiff p = param_diff(model, ref);
    std::printf(
        "%-24s one process: losses %.7f %.7f %.7f %.7f %.7f; max relative loss difference %.3g; final "
        "parameters %.3g of their tensor's max (%s); moved by training %.3g\n",
        name.c_str(), losses[0], losses[1], losses[2], losses[3], losses[4], loss_diff, p.worst, p.where.c_str(),
        moved);
    EXPECT_EQ(p.elements, total_elements(ref)) << name;
    EXPECT_LE(loss_diff, kTolerance) << name;
    EXPECT_LE(p.worst, kTolerance) << name << " at " << p.where;
    EXPECT_GT(moved, 1e-3) << name;
  }
}
