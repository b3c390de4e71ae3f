#pragma once
// FSDP2's custom collectives (FSDPModule::set_custom_all_gather / set_custom_reduce_scatter): a
// unit's all-gather or reduce-scatter made by the user's code, another transport or memory of its
// own, instead of FSDP's call on the shard group. FSDP still builds the rows (copy-in, the
// reduce-scatter input) and reads them (copy-out, the sharded gradients); the user's object
// allocates the buffers the collective reads and writes, and moves the bytes.
//
// Example:
//   struct CountedAllGather : fsdp::AllGather {
//     fsdp::comm::Work operator()(const at::Tensor& output, const at::Tensor& input, fsdp::comm::Comm& group,
//                                 bool async_op) override {
//       ++calls;
//       return group.all_gather_into_tensor(output, input, async_op);
//     }
//     int calls = 0;
//   };
//   auto gather = std::make_shared<CountedAllGather>();
//   fsdp::fully_shard(block).set_custom_all_gather(gather);
//
// A unit with either one takes FSDP's general path for that collective: one flat buffer per unit,
// as FSDP2 lays it out, never the CPU's per-parameter rows or a world of one's direct hand-over.
// They apply to every all-gather or reduce-scatter of the unit, including backward's within the
// post-forward group of an integer reshard_after_forward (`group` is then that group). HSDP's
// all-reduce over the replicas stays FSDP's.
#include <ATen/ATen.h>

#include "fsdp/comm/comm.h"

namespace fsdp {

// The all-gather of a unit: `output` is [world * n] flat, `input` its row `rank` (n elements,
// already written by copy-in: the gather is in place). Called with async_op true; the Work returned
// is waited for before the rows are read (a completed Work() when the call finished them itself).
// On a GPU it is called on FSDP's all-gather stream, as the group's own call would be.
class AllGather {
 public:
  virtual ~AllGather() = default;
  // The output buffer (`sizes` is {world * n}), once per all-gather; it must be contiguous, of the
  // given dtype and device. The default is at::empty.
  virtual at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) {
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  }
  virtual comm::Work operator()(const at::Tensor& output, const at::Tensor& input, comm::Comm& group,
                                bool async_op) = 0;
};

// The reduce-scatter of a unit's gradients: `input` is [world * n] flat in the reduce dtype (rank
// r's rows at r * n, the padding zero), `output` n elements, this rank's reduced rows. `op` is Avg,
// or Sum where a gradient divide factor is set or sums are forced (set_force_sum_reduction_for_comms;
// FSDP divides afterwards). Called with async_op true, as AllGather's; on a GPU on FSDP's
// reduce-scatter stream.
class ReduceScatter {
 public:
  virtual ~ReduceScatter() = default;
  // The input ({world * n}) and the output ({n}) buffers, each once per reduce-scatter.
  virtual at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) {
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  }
  virtual comm::Work operator()(const at::Tensor& output, const at::Tensor& input, comm::Comm& group, comm::ReduceOp op,
                                bool async_op) = 0;
};

}  // namespace fsdp
