#pragma once
// Random-number-generator state for activation checkpointing's replay, on every LibTorch:
//  - the CPU generator always;
//  - the default generator of each accelerator device (CUDA) the inputs live on, and of the
//    devices the caller adds (a checkpointed module's parameters'), found at run time through
//    at::globalContext().defaultGenerator(device), so this compiles and runs without CUDA (a
//    CPU-only build never sees a CUDA tensor).
// Why activation checkpointing is reentrant-style here: LibTorch's saved-tensor default hooks
// (at::SavedTensorDefaultHooks, what torch.utils.checkpoint's non-reentrant mode uses) take
// PyObject* pack/unpack hooks in 1.13 and SafePyObject in 2.x; neither version offers a C++ hook.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <mutex>
#include <utility>
#include <vector>

namespace fsdp::compat {

struct RngState {
  at::Tensor cpu;
  std::vector<std::pair<at::Device, at::Tensor>> devices;
};

inline at::Tensor generator_state(const at::Generator& gen) {
  std::lock_guard<std::mutex> lock(const_cast<at::Generator&>(gen).mutex());
  return gen.get_state();
}

inline void set_generator_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The generators that the computation on `inputs` may draw from: the CPU's, and those of the
// CUDA devices the inputs live on and of `devices` (a checkpointed module's parameters' devices:
// a block whose inputs are elsewhere still draws its dropout on its parameters' device).
inline RngState capture_rng_state(const std::vector<at::Tensor>& inputs, const std::vector<at::Device>& devices = {}) {
  RngState s;
  s.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  auto add = [&s](const at::Device& device) {
    if (device.type() != at::kCUDA) return;
    for (const auto& d : s.devices) {
      if (d.first == device) return;
    }
    if (at::hasCUDA()) s.devices.emplace_back(device, generator_state(at::globalContext().defaultGenerator(device)));
  };
  for (const auto& t : inputs) {
    if (t.defined()) add(t.device());
  }
  for (const auto& d : devices) add(d);
  return s;
}

// The current states of the generators `like` holds.
inline RngState current_rng_state(const RngState& like) {
  RngState s;
  s.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  for (const auto& d : like.devices) {
    s.devices.emplace_back(d.first, generator_state(at::globalContext().defaultGenerator(d.first)));
  }
  return s;
}

inline void restore_rng_state(const RngState& s) {
  if (s.cpu.defined()) set_generator_state(at::detail::getDefaultCPUGenerator(), s.cpu);
  for (const auto& d : s.devices) set_generator_state(at::globalContext().defaultGenerator(d.first), d.second);
}

}  // namespace fsdp::compat
