// Expert parallelism (fsdp::ep::dispatch / combine) against the same mixture-of-experts layer in
// one process on the same global tokens: a toy MoE (E experts of Linear-SiLU-Linear, a softmax
// router with top-2) whose outputs and gradients (of the tokens, the router's weights and each
// expert's weights on the rank that owns it) match to 1e-6 of their largest magnitude in fp32, at
// 2 and 4 ranks, with even and uneven routing (an expert, and at 4 ranks a whole rank, receiving
// no tokens; a rank with no tokens of its own); the all-to-all bytes of the step equal the formula
// from the routing; a group of one equals the local computation; and dp 2 x ep 2 under
// fully_shard (the router over all ranks, each expert over its "dp" ranks) equals one process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "fsdp/debug/comm_stats.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"

namespace {

constexpr int64_t kDim = 8, kFfn = 12, kTopK = 2;

// The layer's parameters, the same on every rank (one seed).
struct MoeWeights {
  at::Tensor router_w, router_b;  // [E, D], [E]
  std::vector<at::Tensor> w1, b1, w2, b2;
  int64_t experts = 0;

  std::vector<at::Tensor> expert_params(int64_t e) const { return {w1[e], b1[e], w2[e], b2[e]}; }
  std::vector<at::Tensor> all() const {
    std::vector<at::Tensor> p{router_w, router_b};
    for (int64_t e = 0; e < experts; ++e) {
      for (const auto& t : expert_params(e)) p.push_back(t);
    }
    return p;
  }
};

// `dead` > 0: the router's bias sends most tokens to expert 0 and none to the last `dead` experts.
MoeWeights make_weights(int64_t experts, int64_t dead) {
  torch::manual_seed(1234);
  MoeWeights m;
  m.experts = experts;
  m.router_w = at::randn({experts, kDim}) * 0.5;
  m.router_b = at::zeros({experts});
  if (dead > 0) {
    m.router_b[0] = 2.0;
    m.router_b.narrow(0, experts - dead, dead).fill_(-100.0);
  }
  for (int64_t e = 0; e < experts; ++e) {
    m.w1.push_back(at::randn({kFfn, kDim}) * 0.3);
    m.b1.push_back(at::randn({kFfn}) * 0.1);
    m.w2.push_back(at::randn({kDim, kFfn}) * 0.3);
    m.b2.push_back(at::randn({kDim}) * 0.1);
  }
  for (auto& t : m.all()) t.requires_grad_(true);
  return m;
}

at::Tensor expert_forward(const MoeWeights& m, int64_t e, const at::Tensor& x) {
  return at::linear(at::silu(at::linear(x, m.w1[e], m.b1[e])), m.w2[e], m.b2[e]);
}

std::pair<at::Tensor, at::Tensor> route(const MoeWeights& m, const at::Tensor& x) {
  auto [w, idx] = at::softmax(at::linear(x, m.router_w, m.router_b), -1).topk(kTopK, -1);
  return {w, idx};
}

// The layer in one process: each expert's tokens gathered, one matmul per expert, added back.
at::Tensor moe_local(const MoeWeights& m, const at::Tensor& x, const at::Tensor& w, const at::Tensor& idx) {
  at::Tensor y = at::zeros_like(x);
  for (int64_t e = 0; e < m.experts; ++e) {
    const at::Tensor hit = idx.eq(e).nonzero();  // [n, 2]: (token, j)
    if (hit.size(0) == 0) continue;
    const at::Tensor tok = hit.select(1, 0), j = hit.select(1, 1);
    const at::Tensor out = expert_forward(m, e, x.index_select(0, tok));
    y = y.index_add(0, tok, out * w.index({tok, j}).unsqueeze(-1));
  }
  return y;
}

// The layer with expert parallelism: this rank runs its E / ep experts on what dispatch brings.
at::Tensor moe_ep(const MoeWeights& m, const at::Tensor& w, const std::function<fsdp::ep::Dispatched()>& do_dispatch,
                  int rank) {
  fsdp::ep::Dispatched d = do_dispatch();
  const int64_t local = static_cast<int64_t>(d.counts.size());
  TORCH_CHECK(d.tokens.size(0) == std::accumulate(d.counts.begin(), d.counts.end(), int64_t{0}), "counts");
  std::vector<at::Tensor> outs;
  int64_t row = 0;
  for (int64_t l = 0; l < local; ++l) {
    outs.push_back(expert_forward(m, rank * local + l, d.tokens.narrow(0, row, d.counts[l])));
    row += d.counts[l];
  }
  return fsdp::ep::combine(at::cat(outs), w, d);
}

// Within 1e-6 of the reference's largest magnitude (an undefined gradient is zeros).
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  const at::Tensor g = got.defined() ? got : at::zeros_like(want);
  const at::Tensor r = want.defined() ? want : at::zeros_like(g);
  TORCH_CHECK(g.sizes() == r.sizes(), what, ": shape ", g.sizes(), " vs ", r.sizes());
  if (r.numel() == 0) return;
  const double scale = std::max(r.abs().max().item<double>(), 1e-30);
  const double diff = (g - r).abs().max().item<double>();
  TORCH_CHECK(diff <= 1e-6 * scale, what, ": max |ep - local| = ", diff, " > 1e-6 x ", scale);
}

// Rank r's tokens: a slice of the global batch (sizes differ by rank; `empty_rank` has none).
std::vector<int64_t> token_counts(int n, int empty_rank) {
  std::vector<int64_t> counts;
  for (int s = 0; s < n; ++s) counts.push_back(s == empty_rank ? 0 : 5 + 2 * s);
  return counts;
}

struct Case {
  int64_t experts;
  int64_t dead;    // the last experts, which the router never picks
  int empty_rank;  // a rank with no tokens of its own (-1: none)
};

void run_case(const Case& c, bool through_mesh) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  const std::vector<int64_t> counts = token_counts(n, c.empty_rank);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t first = std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
  torch::manual_seed(99);
  const at::Tensor global_x = at::randn({total, kDim}), target = at::randn({total, kDim});

  // One process, all experts, the global batch.
  MoeWeights ref = make_weights(c.experts, c.dead);
  const at::Tensor ref_x = global_x.clone().requires_grad_(true);
  auto [ref_w, ref_idx] = route(ref, ref_x);
  const at::Tensor ref_y = moe_local(ref, ref_x, ref_w, ref_idx);
  (ref_y * target).sum().backward();

  // Expert parallel: this rank's tokens, its experts; the loss is the sum of the ranks' losses.
  MoeWeights ep = make_weights(c.experts, c.dead);
  const at::Tensor x = global_x.narrow(0, first, counts[r]).clone().requires_grad_(true);
  auto [w, idx] = route(ep, x);
  const fsdp::DeviceMesh mesh = fsdp::DeviceMesh::from_group(comm, "cpu", "ep");
  fsdp::comm::Comm& group = *comm;
  const auto before = group.stats().snapshot();
  const at::Tensor y = moe_ep(
      ep, w,
      [&] {
        return through_mesh ? fsdp::ep::dispatch(x, idx, c.experts, mesh)
                            : fsdp::ep::dispatch(x, idx, c.experts, group);
      },
      r);
  (y * target.narrow(0, first, counts[r])).sum().backward();
  const uint64_t moved = (group.stats().snapshot() - before)[fsdp::comm::OpKind::AllToAll].bytes_sent;

  const std::string at = "E=" + std::to_string(c.experts) +
                         (c.dead ? " with " + std::to_string(c.dead) + " idle" : std::string()) + " rank " +
                         std::to_string(r);
  TORCH_CHECK(torch::equal(idx, ref_idx.narrow(0, first, counts[r])), at, ": routing differs from the reference");
  expect_close(y, ref_y.narrow(0, first, counts[r]).detach(), at + " output");
  expect_close(x.grad(), ref_x.grad().narrow(0, first, counts[r]), at + " grad of hidden");
  // The router's gradient: each rank has its tokens' part; their sum is the reference's.
  for (auto* p : {&ep.router_w, &ep.router_b}) {
    at::Tensor g = p->grad().defined() ? p->grad().clone() : at::zeros_like(*p);
    comm->all_reduce(g);
    expect_close(g, (p == &ep.router_w ? ref.router_w : ref.router_b).grad(), at + " grad of the router");
  }
  const int64_t local = c.experts / n;
  for (int64_t e = r * local; e < (r + 1) * local; ++e) {
    const auto mine = ep.expert_params(e), theirs = ref.expert_params(e);
    for (size_t i = 0; i < mine.size(); ++i) {
      expect_close(mine[i].grad(), theirs[i].grad(),
                   at + " grad of expert " + std::to_string(e) + " param " + std::to_string(i));
    }
  }
  // Bytes: the formula from every rank's routing (the reference's, sliced by rank).
  std::vector<at::Tensor> routing;
  for (int s = 0; s < n; ++s) {
    routing.push_back(ref_idx.narrow(0, std::accumulate(counts.begin(), counts.begin() + s, int64_t{0}), counts[s]));
  }
  const auto want = fsdp::ep::all_to_all_bytes(routing, c.experts, r, kDim * 4);
  TORCH_CHECK(moved == want.total(), at, ": all-to-all bytes counted ", moved, ", the formula says ", want.total(),
              " (counts ", want.counts, ", forward ", want.forward, ", backward ", want.backward, ")");
  std::cout << at << ": output and gradients match; all-to-all bytes " << moved << " = formula" << std::endl;
}

}  // namespace

FSDP_RANK_WORKER(ep_matches_local) {
  const int n = fsdp::dist::world_size();
  run_case({2 * n, 0, -1}, false);           // even routing
  run_case({n == 4 ? 8 : 4, 1, -1}, false);  // uneven: expert 0 takes most, the last one none
  // The last rank's experts get no tokens and rank 0 has none of its own; through the mesh.
  run_case({2 * n, 2, 0}, true);
}

// Composed with fully_shard as torchtitan does, 4 ranks as dp 2 x ep 2: the router (dense)
// sharded over all 4 ranks, each local expert over the "dp" ranks that hold it, with the gradient
// divided by the world size (each expert's gradient already sums the tokens of its ep group).
struct ExpertImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  ExpertImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kDim, kFfn));
    fc2 = register_module("fc2", torch::nn::Linear(kFfn, kDim));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::silu(fc1(x))); }
};
TORCH_MODULE(Expert);

struct MoeLayerImpl : torch::nn::Module {
  torch::nn::Linear router{nullptr};
  std::vector<Expert> experts;  // this rank's, global ids first_expert + l
  fsdp::comm::Comm* ep = nullptr;
  int64_t num_experts = 0;
  MoeLayerImpl(const MoeWeights& m, int64_t first_expert, int64_t local) : num_experts(m.experts) {
    router = register_module("router", torch::nn::Linear(torch::nn::LinearOptions(kDim, m.experts).bias(false)));
    at::NoGradGuard no_grad;
    router->weight.copy_(m.router_w);
    for (int64_t l = 0; l < local; ++l) {
      experts.push_back(register_module("expert" + std::to_string(l), Expert()));
      const auto full = m.expert_params(first_expert + l);
      experts.back()->fc1->weight.copy_(full[0]);
      experts.back()->fc1->bias.copy_(full[1]);
      experts.back()->fc2->weight.copy_(full[2]);
      experts.back()->fc2->bias.copy_(full[3]);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    auto [w, idx] = at::softmax(router(x), -1).topk(kTopK, -1);
    fsdp::ep::Dispatched d = fsdp::ep::dispatch(x, idx, num_experts, *ep);
    std::vector<at::Tensor> outs;
    int64_t row = 0;
    for (size_t l = 0; l < experts.size(); ++l) {
      outs.push_back(fsdp::call(experts[l], d.tokens.narrow(0, row, d.counts[l])));
      row += d.counts[l];
    }
    return fsdp::ep::combine(at::cat(outs), w, d);
  }
};
TORCH_MODULE(MoeLayer);

// The rows of the reference's gradient this rank's shard holds.
at::Tensor shard_rows(const at::Tensor& sharded, const at::Tensor& full_grad) {
  const auto info = fsdp::shard_info(sharded);
  TORCH_CHECK(info && info->shard_dim == 0, "not a dim-0 shard");
  return full_grad.narrow(0, info->dim0_offset, info->local_rows);
}

FSDP_RANK_WORKER(ep_with_fully_shard) {
  auto world = fsdp::dist::world_comm();
  const int r = world->rank(), n = world->size();
  TORCH_CHECK(n == 4, "dp 2 x ep 2 needs 4 ranks");
  const int64_t experts = 4, tokens = 6;
  auto mesh = fsdp::init_device_mesh({2, 2}, {"dp", "ep"});
  auto ep = mesh.comm("ep");
  const int64_t local = experts / ep->size();
  torch::manual_seed(7);
  const at::Tensor global_x = at::randn({n * tokens, kDim}), target = at::randn({n * tokens, kDim});
  // Reference: one process, every expert, every rank's tokens; the loss averaged over the ranks.
  MoeWeights ref = make_weights(experts, 0);
  ref.router_b.requires_grad_(false);
  const at::Tensor ref_x = global_x.clone();
  auto [ref_w, ref_idx] = at::softmax(at::linear(ref_x, ref.router_w), -1).topk(kTopK, -1);
  const at::Tensor ref_y = moe_local(ref, ref_x, ref_w, ref_idx);
  ((ref_y * target).view({n, tokens, kDim}).sum({1, 2}).mean()).backward();

  MoeLayer layer(ref, ep->rank() * local, local);
  layer->ep = ep.get();
  fsdp::FullyShardOptions expert_opts;
  expert_opts.mesh = mesh["dp"];
  for (auto& e : layer->experts) fsdp::fully_shard(e, expert_opts).set_gradient_divide_factor(n);
  fsdp::FullyShardOptions root_opts;
  root_opts.mesh = mesh.flatten("world");
  fsdp::fully_shard(layer, root_opts);
  const at::Tensor x = global_x.narrow(0, r * tokens, tokens);
  const at::Tensor y = fsdp::call(layer, x);
  (y * target.narrow(0, r * tokens, tokens)).sum().backward();

  expect_close(y.detach(), ref_y.narrow(0, r * tokens, tokens).detach(), "rank " + std::to_string(r) + " output");
  // The module's parameters are now the shards (parameters(), not the Linear's members).
  auto params = layer->named_parameters(/*recurse=*/true);
  const at::Tensor rw = params["router.weight"];
  expect_close(rw.grad(), shard_rows(rw, ref.router_w.grad()), "router grad shard");
  for (int64_t l = 0; l < local; ++l) {
    const auto full = ref.expert_params(ep->rank() * local + l);
    const std::string pre = "expert" + std::to_string(l) + ".";
    const char* names[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
    for (size_t i = 0; i < 4; ++i) {
      const at::Tensor mine = params[pre + names[i]];
      expect_close(mine.grad(), shard_rows(mine, full[i].grad()),
                   "rank " + std::to_string(r) + " expert " + std::to_string(ep->rank() * local + l) + " " + names[i]);
    }
  }
  std::cout << "rank " << r << ": dp 2 x ep 2 under fully_shard matches one process" << std::endl;
}

TEST(ExpertParallel, DpTimesEpUnderFullyShard) { EXPECT_RANKS_PASS(4, "ep_with_fully_shard"); }

TEST(ExpertParallel, TwoRanksMatchOneProcess) { EXPECT_RANKS_PASS(2, "ep_matches_local"); }
TEST(ExpertParallel, FourRanksMatchOneProcess) { EXPECT_RANKS_PASS(4, "ep_matches_local"); }

// ep = 1: the same code with a group of one is the local computation, and moves nothing.
TEST(ExpertParallel, GroupOfOneEqualsLocal) {
  auto one = fsdp::comm::Comm::single_process("ep");
  for (int64_t dead : {0, 1}) {
    MoeWeights ref = make_weights(4, dead), ep = make_weights(4, dead);
    torch::manual_seed(5);
    const at::Tensor x0 = at::randn({11, kDim}), target = at::randn({11, kDim});
    const at::Tensor rx = x0.clone().requires_grad_(true), ex = x0.clone().requires_grad_(true);
    auto [rw, ridx] = route(ref, rx);
    const at::Tensor ry = moe_local(ref, rx, rw, ridx);
    (ry * target).sum().backward();
    auto [w, idx] = route(ep, ex);
    const at::Tensor y = moe_ep(
        ep, w, [&] { return fsdp::ep::dispatch(ex, idx, 4, *one); }, 0);
    (y * target).sum().backward();
    expect_close(y, ry.detach(), "ep=1 output");
    expect_close(ex.grad(), rx.grad(), "ep=1 grad of hidden");
    for (size_t i = 0; i < ref.all().size(); ++i) expect_close(ep.all()[i].grad(), ref.all()[i].grad(), "ep=1 param");
  }
  EXPECT_EQ(one->stats().snapshot()[fsdp::comm::OpKind::AllToAll].bytes_sent, 0U);
}

// Bad input in one line, before any collective.
TEST(ExpertParallel, BadInputNamesTheProblem) {
  auto one = fsdp::comm::Comm::single_process("ep");
  const at::Tensor x = at::randn({3, kDim});
  const at::Tensor idx = at::tensor({0, 1, 2, 3, 1, 0}, at::kLong).view({3, 2});
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { fsdp::ep::dispatch(x, idx, 3, *one); }).find("expert id 3, outside [0, 3)"),
            std::string::npos);
  EXPECT_NE(message([&] { fsdp::ep::dispatch(x, idx.to(at::kInt), 4, *one); }).find("int64"), std::string::npos);
  EXPECT_NE(message([&] { fsdp::ep::dispatch(x.narrow(0, 0, 2), idx, 4, *one); }).find("one row of expert ids"),
            std::string::npos);
  const auto d = fsdp::ep::dispatch(x, idx, 4, *one);
  EXPECT_NE(message([&] {
              fsdp::ep::combine(at::randn({5, kDim}), at::rand({3, 2}), d);
            }).find("expert_out must be [6"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fsdp::ep::combine(at::randn({6, kDim}), at::rand({3, 1}), d);
            }).find("topk_weight must be [3, 2]"),
            std::string::npos);
}

// The formula itself on a hand-counted routing: 2 ranks, 4 experts (rank 0 owns 0-1, rank 1 2-3).
TEST(ExpertParallel, BytesFormulaByHand) {
  const at::Tensor r0 = at::tensor({0, 2, 3, 1}, at::kLong).view({2, 2});        // 2 rows leave rank 0
  const at::Tensor r1 = at::tensor({0, 1, 2, 3, 0, 3}, at::kLong).view({3, 2});  // 3 rows come to rank 0
  const auto b = fsdp::ep::all_to_all_bytes({r0, r1}, 4, 0, 32);
  EXPECT_EQ(b.counts, 16U);  // 2 counts of 8 bytes to the other rank
  EXPECT_EQ(b.forward, (2U + 3U) * 32U);
  EXPECT_EQ(b.backward, b.forward);
  EXPECT_EQ(fsdp::ep::all_to_all_bytes({r0}, 4, 0, 32).total(), 0U);
}
