#pragma once
// FSDP's CPU collectives in the flat layout for a scope, whatever FSDP_CPU_COLLECTIVES and
// FSDP_CPU_PIECE_BYTES say; the options before come back at scope exit. For checks that assume one
// padded flat message per unit (byte counts, a unit's gradients as rows of one buffer): the
// per-parameter layout sends each rank's own rows, without padding (tests/README.md, "The
// per-parameter path").
//
//   const fsdp::testing::FlatCpuCollectives flat;   // at the top of a rank worker
#include "fsdp/debug/cpu_collectives.h"

namespace fsdp::testing {

class FlatCpuCollectives {
 public:
  FlatCpuCollectives() : before_(fsdp::cpu_collective_options()) {
    fsdp::CpuCollectiveOptions flat = before_;
    flat.gather_per_parameter = flat.reduce_per_parameter = false;
    fsdp::set_cpu_collective_options(flat);
  }
  ~FlatCpuCollectives() { fsdp::set_cpu_collective_options(before_); }
  FlatCpuCollectives(const FlatCpuCollectives&) = delete;
  FlatCpuCollectives& operator=(const FlatCpuCollectives&) = delete;

 private:
  fsdp::CpuCollectiveOptions before_;
};

}  // namespace fsdp::testing
