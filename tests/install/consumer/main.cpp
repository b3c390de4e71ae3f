#include <fsdp/debug.h>  // tune_cpu_or_reexec: the diagnostics and tuning tier installs too
#include <fsdp/fsdp.h>

#include <cstdio>

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  fsdp::dist::init_distributed();
  auto mesh = fsdp::init_device_mesh({fsdp::dist::world_size()}, {"shard"});
  at::Tensor t = at::ones({4});
  mesh.comm()->all_reduce(t, fsdp::comm::ReduceOp::Avg);
  std::printf("consumer OK: %s, sum %.1f\n", mesh.to_string().c_str(), t.sum().item<float>());
  return t.sum().item<float>() == 4.0f ? 0 : 1;
}
