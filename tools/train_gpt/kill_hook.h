#pragma once
// The test hook FSDP_TEST_KILL_AT_STEP (documented in tools/train_gpt/README.md, "Test hook"):
// FSDP_TEST_KILL_AT_STEP=k makes rank FSDP_TEST_KILL_RANK (default 1) SIGKILL itself just before
// step k+1, on the first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0), so a test can
// check that fsdprun's restart resumes from the last checkpoint.
//
// Example: const KillHook hook = KillHook::from_env();  ...  hook.before_step(step, rank);
#include <cstdint>

namespace train_gpt {

class KillHook {
 public:
  // Reads the environment once (unset: the hook never fires).
  static KillHook from_env();
  // SIGKILLs this process when `step` (steps completed) is the hook's and `rank` its rank.
  void before_step(int64_t step, int rank) const;

 private:
  int64_t kill_at_ = -1;
  int kill_rank_ = 1;
};

}  // namespace train_gpt
