// layer: sharding
#pragma once
// GPU only: how long the compute stream stood still waiting for all-gathers, i.e. the part of
// each all-gather that overlap did not hide (see [Note: FSDP streams] in src/sharding/streams.h).
//
//   fsdp::set_all_gather_wait_timing(true);   // before the steps to measure (costs two events per unshard)
//   ... training steps ...
//   double s = fsdp::all_gather_wait_seconds();  // waits for the GPU, then sums; resets the sum
//
// On CPU meshes (and CPU builds of LibTorch) nothing is recorded and the sum stays 0.
namespace fsdp {

void set_all_gather_wait_timing(bool on);
double all_gather_wait_seconds();

}  // namespace fsdp
