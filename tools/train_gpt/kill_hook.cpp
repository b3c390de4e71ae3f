#include "kill_hook.h"

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace train_gpt {

KillHook KillHook::from_env() {
  KillHook hook;
  if (const char* k = std::getenv("FSDP_TEST_KILL_AT_STEP")) {
    const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if (restart == nullptr || std::string(restart) == "0") hook.kill_at_ = std::atoll(k);
    if (const char* kr = std::getenv("FSDP_TEST_KILL_RANK")) hook.kill_rank_ = std::atoi(kr);
  }
  return hook;
}

void KillHook::before_step(int64_t step, int rank) const {
  if (step != kill_at_ || rank != kill_rank_) return;
  std::fprintf(stderr, "train_gpt: FSDP_TEST_KILL_AT_STEP=%lld: rank %d kills itself\n",
               static_cast<long long>(kill_at_), rank);
  std::fflush(stderr);
  raise(SIGKILL);
}

}  // namespace train_gpt
