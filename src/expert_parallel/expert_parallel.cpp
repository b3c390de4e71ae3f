#include "fsdp/expert_parallel/expert_parallel.h"

#include <torch/torch.h>

#include <numeric>
#include <stdexcept>
#include <string>

#include "fsdp/compat/autograd_node.h"
#include "fsdp/debug/profiler.h"

namespace fsdp::ep {

namespace detail {

// One dispatch's bookkeeping. Rows are (token, j) assignments, a = t * k + j.
struct DispatchPlan {
  comm::Comm* comm = nullptr;
  std::shared_ptr<comm::Comm> owner;  // the mesh overload's group, kept alive
  int64_t tokens = 0, top_k = 0;
  std::vector<int64_t> send_splits;  // dispatch: rows to each rank
  std::vector<int64_t> recv_splits;  // dispatch: rows from each rank
  at::Tensor order;                  // [T*k]: the assignment at each sorted (by expert) position
  at::Tensor inverse_order;          // [T*k]: the sorted position of each assignment
  at::Tensor regroup;                // [N_local]: the received row at each grouped position
  at::Tensor ungroup;                // [N_local]: the grouped position of each received row
};

}  // namespace detail

namespace {

using detail::DispatchPlan;
using torch::autograd::variable_list;

[[noreturn]] void bad_input(const char* fn, const std::string& why) {
  throw std::invalid_argument(std::string("fsdp::ep::") + fn + ": " + why);
}

// Moves rows: in_splits[j] of x's rows to rank j, out_splits[j] rows from rank j.
at::Tensor exchange_rows(const at::Tensor& x, const std::vector<int64_t>& in_splits,
                         const std::vector<int64_t>& out_splits, comm::Comm& comm) {
  const profiler::Range range("fsdp::ep_collective", "all_to_all");
  at::Tensor in = x.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  at::Tensor out = at::empty(shape, in.options());
  comm.all_to_all(out, in, out_splits, in_splits);
  return out;
}

// [Note: the all-to-alls of expert parallelism in backward]
// The adjoint of moving rows between ranks is moving them back: the backward of a forward
// all-to-all with splits (in, out) is the all-to-all with (out, in). It is a collective, so every
// rank must run it, also a rank whose rows need no gradient or that has no rows at all: under grad
// mode the node is made whatever its input needs, and combine's node also points at dispatch's
// tokens (an undefined gradient), so that reaching combine in backward reaches dispatch's node on
// every rank, even where the experts did not use their (empty) tokens. An undefined incoming
// gradient is sent as zeros.
struct RowsAllToAllBackward final : torch::autograd::Node {
  RowsAllToAllBackward(std::shared_ptr<DispatchPlan> plan, bool dispatch)
      : plan_(std::move(plan)), dispatch_(dispatch) {}
  variable_list apply(variable_list&& grads) override {
    at::Tensor g = grads[0].defined() ? grads[0] : input_metadata(0).zeros_like();
    // Forward sent (send, recv) for dispatch and (recv, send) for combine; backward swaps.
    const auto& in = dispatch_ ? plan_->recv_splits : plan_->send_splits;
    const auto& out = dispatch_ ? plan_->send_splits : plan_->recv_splits;
    variable_list result(num_outputs());
    result[0] = exchange_rows(g, in, out, *plan_->comm);
    return result;
  }
  std::string name() const override { return dispatch_ ? "fsdp::ep::DispatchBackward" : "fsdp::ep::CombineBackward"; }

 private:
  std::shared_ptr<DispatchPlan> plan_;
  bool dispatch_;
};

// The forward all-to-all of dispatch (rows by destination) or combine (rows back), with its node.
// `also` (combine: dispatch's tokens) is a further input that gets no gradient.
at::Tensor rows_all_to_all(const at::Tensor& x, const std::shared_ptr<DispatchPlan>& plan, bool dispatch,
                           const at::Tensor& also = at::Tensor()) {
  const auto& in = dispatch ? plan->send_splits : plan->recv_splits;
  const auto& out = dispatch ? plan->recv_splits : plan->send_splits;
  at::Tensor moved;
  {
    at::NoGradGuard no_grad;
    moved = exchange_rows(x, in, out, *plan->comm);
  }
  if (!torch::GradMode::is_enabled() || !at::isFloatingType(x.scalar_type())) return moved;
  auto node = compat::make_autograd_node<RowsAllToAllBackward>(plan, dispatch);
  torch::autograd::edge_list edges{torch::autograd::impl::gradient_edge(x)};
  if (also.defined()) edges.push_back(torch::autograd::impl::gradient_edge(also));
  node->set_next_edges(std::move(edges));
  torch::autograd::impl::set_gradient_edge(moved, {node, node->add_input_metadata(moved)});
  return moved;
}

void check_dispatch_inputs(const at::Tensor& hidden, const at::Tensor& topk_idx, int64_t num_experts, int ep_size) {
  const char* fn = "dispatch";
  if (!hidden.defined() || hidden.dim() != 2) bad_input(fn, "hidden must be a [tokens, dim] tensor");
  if (!topk_idx.defined() || topk_idx.dim() != 2 || topk_idx.scalar_type() != at::kLong) {
    bad_input(fn, "topk_idx must be a [tokens, k] int64 tensor of expert ids (topk's indices)");
  }
  if (topk_idx.size(0) != hidden.size(0)) {
    bad_input(fn, "topk_idx has " + std::to_string(topk_idx.size(0)) + " rows but hidden has " +
                      std::to_string(hidden.size(0)) + " tokens; give one row of expert ids per token");
  }
  if (topk_idx.device() != hidden.device()) bad_input(fn, "topk_idx and hidden must be on one device");
  if (num_experts <= 0 || num_experts % ep_size != 0) {
    bad_input(fn, "num_experts " + std::to_string(num_experts) + " is not a positive multiple of the ep size " +
                      std::to_string(ep_size) + "; choose an ep size that divides the number of experts");
  }
  if (topk_idx.numel() > 0) {
    const int64_t lo = topk_idx.min().item<int64_t>(), hi = topk_idx.max().item<int64_t>();
    if (lo < 0 || hi >= num_experts) {
      bad_input(fn, "topk_idx holds expert id " + std::to_string(lo < 0 ? lo : hi) + ", outside [0, " +
                        std::to_string(num_experts) + ")");
    }
  }
}

// Splits and the regrouping from the tokens-per-expert counts: mine [ep, E/ep] (what this rank
// sends to each rank's experts) and theirs [ep, E/ep] (what each rank sends to this rank's
// experts), both on the CPU. Returns the tokens per local expert.
std::vector<int64_t> plan_rows(DispatchPlan& plan, const at::Tensor& mine, const at::Tensor& theirs) {
  const int64_t n = mine.size(0), local = mine.size(1);
  const auto* m = mine.data_ptr<int64_t>();
  const auto* t = theirs.data_ptr<int64_t>();
  plan.send_splits.assign(static_cast<size_t>(n), 0);
  plan.recv_splits.assign(static_cast<size_t>(n), 0);
  std::vector<int64_t> counts(static_cast<size_t>(local), 0), first(static_cast<size_t>(n * local), 0);
  int64_t offset = 0;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t l = 0; l < local; ++l) {
      plan.send_splits[j] += m[j * local + l];
      plan.recv_splits[j] += t[j * local + l];
      counts[l] += t[j * local + l];
      first[j * local + l] = offset;  // received rows of (source j, local expert l) start here
      offset += t[j * local + l];
    }
  }
  std::vector<int64_t> regroup;
  regroup.reserve(static_cast<size_t>(offset));
  for (int64_t l = 0; l < local; ++l) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < t[j * local + l]; ++i) regroup.push_back(first[j * local + l] + i);
    }
  }
  plan.regroup = at::tensor(regroup, at::kLong).to(mine.device());
  return counts;
}

// The inverse of a permutation index.
at::Tensor inverse_permutation(const at::Tensor& perm) {
  return at::empty_like(perm).scatter_(0, perm, at::arange(perm.numel(), perm.options()));
}

}  // namespace

Dispatched dispatch(const at::Tensor& hidden, const at::Tensor& topk_idx, int64_t num_experts, comm::Comm& ep) {
  const int n = ep.size();
  check_dispatch_inputs(hidden, topk_idx, num_experts, n);
  const int64_t local = num_experts / n;
  auto plan = std::make_shared<DispatchPlan>();
  plan->comm = &ep;
  plan->tokens = hidden.size(0);
  plan->top_k = topk_idx.size(1);
  const at::Tensor flat = topk_idx.reshape(-1);
  // Sorted by expert, hence by destination rank (experts in contiguous blocks); stable, so each
  // expert's rows stay in token order.
  plan->order = std::get<1>(at::sort(flat, /*stable=*/c10::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  plan->inverse_order = inverse_permutation(plan->order);
  const at::Tensor mine = at::bincount(flat, {}, num_experts);
  const at::Tensor theirs = at::empty_like(mine);
  ep.all_to_all(theirs, mine);  // chunk j (rank j's experts) to rank j
  Dispatched d;
  d.counts = plan_rows(*plan, mine.view({n, local}).cpu(), theirs.view({n, local}).cpu());
  plan->regroup = plan->regroup.to(hidden.device());
  plan->ungroup = inverse_permutation(plan->regroup);
  const at::Tensor rows = hidden.index_select(0, at::div(plan->order, plan->top_k, "floor"));
  d.tokens = rows_all_to_all(rows, plan, /*dispatch=*/true).index_select(0, plan->regroup);
  d.plan = std::move(plan);
  return d;
}

Dispatched dispatch(const at::Tensor& hidden, const at::Tensor& topk_idx, int64_t num_experts, const DeviceMesh& mesh) {
  std::shared_ptr<comm::Comm> group = mesh.comm("ep");
  Dispatched d = dispatch(hidden, topk_idx, num_experts, *group);
  d.plan->owner = std::move(group);
  return d;
}

at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& topk_weight, const Dispatched& d) {
  const char* fn = "combine";
  if (!d.plan) bad_input(fn, "the Dispatched has no plan; pass what dispatch() returned");
  const DispatchPlan& plan = *d.plan;
  if (!expert_out.defined() || expert_out.dim() != 2 || expert_out.size(0) != plan.regroup.numel()) {
    bad_input(fn, "expert_out must be [" + std::to_string(plan.regroup.numel()) +
                      ", dim] (one row per dispatched token, in Dispatched::tokens' order); got " +
                      (expert_out.defined() ? c10::str(expert_out.sizes()) : std::string("undefined")));
  }
  if (!topk_weight.defined() || topk_weight.dim() != 2 || topk_weight.size(0) != plan.tokens ||
      topk_weight.size(1) != plan.top_k) {
    bad_input(fn, "topk_weight must be [" + std::to_string(plan.tokens) + ", " + std::to_string(plan.top_k) +
                      "] like dispatch's topk_idx; got " +
                      (topk_weight.defined() ? c10::str(topk_weight.sizes()) : std::string("undefined")));
  }
  const at::Tensor received = expert_out.index_select(0, plan.ungroup);
  const at::Tensor sorted = rows_all_to_all(received, d.plan, /*dispatch=*/false, d.tokens);
  const at::Tensor rows = sorted.index_select(0, plan.inverse_order).view({plan.tokens, plan.top_k, sorted.size(1)});
  return (rows * topk_weight.to(rows.scalar_type()).unsqueeze(-1)).sum(1);
}

AllToAllBytes all_to_all_bytes(const std::vector<at::Tensor>& routing, int64_t num_experts, int rank,
                               int64_t row_bytes) {
  const int64_t n = static_cast<int64_t>(routing.size());
  if (n == 0 || num_experts % n != 0 || rank < 0 || rank >= n) {
    bad_input("all_to_all_bytes", "give one routing per rank (" + std::to_string(n) + "), a rank among them (" +
                                      std::to_string(rank) + ") and experts their count divides (" +
                                      std::to_string(num_experts) + ")");
  }
  const int64_t local = num_experts / n;
  AllToAllBytes b;
  if (n == 1) return b;
  int64_t sent = 0, received = 0;
  for (int64_t s = 0; s < n; ++s) {
    const at::Tensor owner = at::div(routing[static_cast<size_t>(s)].cpu(), local, "floor");
    if (s == rank) {
      sent = owner.ne(rank).sum().item<int64_t>();
    } else {
      received += owner.eq(rank).sum().item<int64_t>();
    }
  }
  b.counts = static_cast<uint64_t>((n - 1) * local * 8);
  b.forward = static_cast<uint64_t>((sent + received) * row_bytes);
  b.backward = b.forward;
  return b;
}

}  // namespace fsdp::ep
