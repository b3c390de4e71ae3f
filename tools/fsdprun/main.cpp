// fsdprun: a torchrun-compatible launcher for LibTorch programs (no Python).
//   fsdprun --nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port P]
//           [--max-restarts R] [--standalone] [--no-python] [--] program args...
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "agent.h"
#include "options.h"
#include "signals.h"
#include "worker_group.h"

int main(int argc, char** argv) {
  using namespace fsdprun;
  // First, before anything starts a thread (c10d's store does): signals become poll events.
  Signals::install();

  Options opts;
  try {
    opts = parse_options(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "fsdprun: %s\n", e.what());
    return 2;
  }
  if (opts.help) {
    std::fputs(usage_text().c_str(), stdout);
    return 0;
  }
  const std::string exe = resolve_executable(opts.program[0]);
  if (exe.empty()) {
    const bool has_slash = opts.program[0].find('/') != std::string::npos;
    std::fprintf(stderr, "fsdprun: cannot run '%s': %s\n", opts.program[0].c_str(),
                 has_slash ? "no executable file at that path; check the path and its execute permission"
                           : "no executable of that name in PATH; give its path, e.g. ./program");
    return 2;
  }

  int rc = 1;
  try {
    Agent agent(opts, exe);
    rc = agent.run();
    if (agent.store_hung()) {
      // A thread is still blocked inside c10d on a silent store: leave without running the
      // destructors it could be racing with. Our own output is unbuffered (write(2)).
      std::fflush(nullptr);
      _exit(rc);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdprun: internal error: %s\n", e.what());
    return 1;
  }
  return rc;
}
