#pragma once
// Expert parallelism (namespace fsdp::ep): the tokens of a mixture-of-experts layer sent to the
// ranks that own their experts and the experts' outputs brought back, by all-to-alls of uneven
// split sizes over the `ep` group (comm::Comm::all_to_all with splits), each one an autograd
// function whose backward is the all-to-all back (the adjoint of a permutation of rows between
// ranks is its inverse). Dropless: every token reaches its k experts, no capacity factor.
//
// Experts are split in contiguous blocks: rank r of `ep` owns experts [r*E/ep, (r+1)*E/ep) of every
// MoE layer (E divisible by the ep size). One dispatch + combine of T tokens routed to k experts:
//   1. counts: one all-to-all of E int64 (tokens per expert, this rank's to every rank);
//   2. dispatch: rows permuted by destination (rank, expert), the uneven all-to-all, and rows
//      regrouped by local expert (local expert 0's rows first, each expert's rows in source-rank
//      then token order);
//   3. combine: the reverse (ungroup, all-to-all back, unpermute) and the weighted sum over k.
// Backward runs the two row all-to-alls again with the splits swapped. all_to_all_bytes() gives
// what the ep group's byte counters then count, from every rank's routing.
//
// A layer of 8 experts (Linear-SiLU-Linear) with a top-2 router over a mesh's "ep" dimension,
// each rank running its 8 / ep experts:
// Example:
//   auto mesh = fsdp::init_device_mesh({2, 2}, {"dp", "ep"});
//   const int64_t local = 8 / mesh.comm("ep")->size();
//   torch::nn::Linear router(torch::nn::LinearOptions(64, 8).bias(false));
//   std::vector<torch::nn::Sequential> experts;  // global ids mesh.comm("ep")->rank() * local + l
//   for (int64_t l = 0; l < local; ++l) {
//     experts.emplace_back(torch::nn::Linear(64, 256), torch::nn::SiLU(), torch::nn::Linear(256, 64));
//   }
//   at::Tensor hidden = at::randn({16, 64}, at::requires_grad());
//   auto [weights, idx] = at::softmax(router(hidden), -1).topk(2, -1);   // [16, 2] each
//   fsdp::ep::Dispatched d = fsdp::ep::dispatch(hidden, idx, 8, mesh);
//   std::vector<at::Tensor> outs;
//   int64_t row = 0;
//   for (int64_t l = 0; l < local; ++l) {
//     outs.push_back(experts[l]->forward(d.tokens.narrow(0, row, d.counts[l])));
//     row += d.counts[l];
//   }
//   at::Tensor y = fsdp::ep::combine(at::cat(outs), weights, d);          // [16, 64]
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "fsdp/comm/comm.h"
#include "fsdp/mesh/device_mesh.h"

namespace fsdp::ep {

namespace detail {
// The splits and permutations of one dispatch, for its combine and both backwards (opaque).
struct DispatchPlan;
}  // namespace detail

// What this rank's local experts process.
struct Dispatched {
  at::Tensor tokens;                           // [N_local, D], grouped by local expert (expert 0's rows first)
  std::vector<int64_t> counts;                 // tokens per local expert (num_experts / ep size entries)
  std::shared_ptr<detail::DispatchPlan> plan;  // splits and permutations for combine
};

// hidden [T, D] (T may be 0); topk_idx [T, k] int64 global expert ids in [0, num_experts). Rank r
// of `ep` owns experts [r*E/ep, (r+1)*E/ep); `ep` may be a group of one (no communication).
// Collective over `ep`: every rank calls it, with its own tokens. `ep` must outlive the backward.
// Gradients of Dispatched::tokens flow back to `hidden` (summed over a token's k copies).
Dispatched dispatch(const at::Tensor& hidden, const at::Tensor& topk_idx, int64_t num_experts, comm::Comm& ep);
// The same over the mesh dimension named "ep" (the mesh keeps the group alive).
Dispatched dispatch(const at::Tensor& hidden, const at::Tensor& topk_idx, int64_t num_experts, const DeviceMesh& mesh);

// expert_out [N_local, D'] in Dispatched::tokens' order; topk_weight [T, k] (cast to expert_out's
// dtype). Returns [T, D'] with row t = sum_j topk_weight[t, j] * expert_out of (t, j). Gradients
// flow to expert_out (hence the experts), to topk_weight (the router) and, through dispatch, to
// hidden. Collective over dispatch's group.
at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& topk_weight, const Dispatched& d);

// The bytes one rank sends in the all-to-alls of one dispatch + combine, as the ep group's byte
// counters (comm_stats.h, AllToAll) count them.
struct AllToAllBytes {
  uint64_t counts = 0;    // the tokens-per-expert exchange (forward only)
  uint64_t forward = 0;   // dispatch's rows out + combine's rows back
  uint64_t backward = 0;  // the same two all-to-alls transposed
  uint64_t total() const { return counts + forward + backward; }
};
// From every rank's routing: routing[s] is rank s's topk_idx (routing.size() is the ep size), for
// rows of `row_bytes` (D x element size; dispatch's and combine's rows of one size). Rank `rank`
// sends to each other rank r' its rows routed to r''s experts (dispatch, and backward of combine)
// and sends back the rows it received (combine, and backward of dispatch):
//   counts   = (ep - 1) * (E / ep) * 8
//   forward  = backward = (sent + received) * row_bytes,
// sent = #{(t, j) : routing[rank][t, j] on another rank}, received = #{(s != rank, t, j) :
// routing[s][t, j] on `rank`}. No communication.
AllToAllBytes all_to_all_bytes(const std::vector<at::Tensor>& routing, int64_t num_experts, int rank,
                               int64_t row_bytes);

}  // namespace fsdp::ep
