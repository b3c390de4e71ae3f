// A tour of the foundation: start under fsdprun, build a mesh, shard a tensor, gather it back,
// reduce-scatter "gradients", and report the bytes each collective moved.
//
//   fsdprun --nproc-per-node 2 -- build/examples/collectives_demo [--mb 13] [--iters 5]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <torch/torch.h>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  double megabytes = 13.0;  // the size of the 3.3M-parameter benchmark GPT in float32
  int iters = 5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mb" && i + 1 < argc)
      megabytes = std::atof(argv[++i]);
    else if (a == "--iters" && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--mb MEGABYTES] [--iters N]\n", argv[0]);
      return 2;
    }
  }
  try {
    fsdp::dist::init_distributed();
    const int rank = fsdp::dist::rank(), world = fsdp::dist::world_size();
    auto mesh = fsdp::init_device_mesh({world}, {"shard"});
    auto comm = mesh.comm("shard");
    std::printf("rank %d of %d (local %d of %d), %s; OMP_NUM_THREADS=%s OPENBLAS_CORETYPE=%s (OpenBLAS core %s)\n",
                rank, world, fsdp::dist::local_rank(), fsdp::dist::local_world_size(), mesh.to_string().c_str(),
                std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "unset",
                std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : "unset",
                fsdp::dist::openblas_loaded_corename().c_str());
    std::fflush(stdout);

    // A "parameter" of rows that the world size does not divide: each rank keeps ceil(rows/N)
    // padded rows (torch.chunk's layout), as fully_shard will.
    const int64_t cols = 256;
    const int64_t rows = static_cast<int64_t>(megabytes * 1e6 / 4 / cols) | 1;
    const int64_t shard_rows = (rows + world - 1) / world;
    torch::manual_seed(0);
    at::Tensor full = torch::randn({rows, cols});
    at::Tensor padded = at::zeros({shard_rows * world, cols});
    padded.narrow(0, 0, rows).copy_(full);
    at::Tensor shard = padded.narrow(0, rank * shard_rows, shard_rows).clone();

    at::Tensor gathered = at::empty({shard_rows * world, cols});
    at::Tensor grad_shard = at::empty({shard_rows, cols});
    at::Tensor grads = at::full({shard_rows * world, cols}, static_cast<float>(rank + 1));
    comm->barrier();
    auto stats0 = fsdp::comm::process_comm_stats().snapshot();
    double gather_s = 0, scatter_s = 0;
    for (int it = 0; it < iters; ++it) {
      auto t0 = std::chrono::steady_clock::now();
      comm->all_gather_into_tensor(gathered, shard, /*async_op=*/true).wait();
      gather_s += seconds_since(t0);
      t0 = std::chrono::steady_clock::now();
      comm->reduce_scatter_tensor(grad_shard, grads, fsdp::comm::ReduceOp::Avg);
      scatter_s += seconds_since(t0);
    }
    const bool gathered_ok = gathered.narrow(0, 0, rows).equal(full);
    const float want_avg = static_cast<float>(world + 1) / 2.0f;
    const bool scattered_ok = grad_shard.eq(want_avg).all().item<bool>();
    at::Tensor ok = at::tensor({gathered_ok && scattered_ok ? 1.0f : 0.0f});
    comm->all_reduce(ok, fsdp::comm::ReduceOp::Sum);
    auto delta = fsdp::comm::process_comm_stats().snapshot() - stats0;
    std::printf(
        "rank %d: %lld x %lld param (%.1f MB), shard %lld rows | all_gather %.1f ms, reduce_scatter %.1f ms"
        " (mean of %d) | %s\n",
        rank, static_cast<long long>(rows), static_cast<long long>(cols), rows * cols * 4 / 1e6,
        static_cast<long long>(shard_rows), 1e3 * gather_s / iters, 1e3 * scatter_s / iters, iters,
        delta.to_string().c_str());
    const bool all_ok = ok.item<float>() == static_cast<float>(world);
    if (rank == 0) {
      std::printf("%s: gathered parameters equal the original on every rank; averaged gradients = %.1f\n",
                  all_ok ? "OK" : "MISMATCH", want_avg);
    }
    comm->barrier();
    fsdp::dist::destroy_distributed();
    return all_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives_demo: %s\n", e.what());
    return 1;
  }
}
