// main() for test binaries with rank workers: a copy started by run_ranks runs its worker only.
#include <execinfo.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "fsdp/debug/cpu_tuning.h"
#include "multiprocess.h"

namespace {

// A crash prints the signal, who sent it, the faulting instruction and the stack (binary(+offset)
// frames: `addr2line -f -C -e BINARY OFFSET` on the unstripped build names them), then dies of the
// same signal: a test binary that crashes on a machine lent for minutes (the GPU check) says where.
void write_str(const char* s) { (void)!write(STDERR_FILENO, s, std::strlen(s)); }

void write_num(const char* label, unsigned long long v) {
  char buf[32];
  int n = 0;
  do {
    const unsigned d = static_cast<unsigned>(v % 16);
    buf[n++] = static_cast<char>(d < 10 ? '0' + d : 'a' + d - 10);
    v /= 16;
  } while (v != 0 && n < 32);
  write_str(label);
  write_str("0x");
  while (n > 0) (void)!write(STDERR_FILENO, &buf[--n], 1);
}

void print_stack_and_die(int sig, siginfo_t* info, void* context) {
  write_str("\nfatal signal: ");
  write_str(strsignal(sig));
  write_num(" si_code=", static_cast<unsigned long long>(info->si_code));
  write_num(" sender_pid=", static_cast<unsigned long long>(info->si_pid));
  write_num(" addr=", reinterpret_cast<unsigned long long>(info->si_addr));
  write_str("\n");
#if defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(context);
  void* where[2] = {reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]), nullptr};
  const auto* sp = reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]);
  if (sp != nullptr) where[1] = *sp;  // the return address, if the fault was a call to a bad address
  write_str("faulting instruction, then the word at the stack pointer:\n");
  backtrace_symbols_fd(where, 2, STDERR_FILENO);
#else
  (void)context;
#endif
  write_str("stack:\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

void print_stack_on_crash() {
  void* warm[1];
  (void)backtrace(warm, 1);  // loads the unwinder now, not inside the handler
  struct sigaction sa {};
  sa.sa_sigaction = print_stack_and_die;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) sigaction(sig, &sa, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  print_stack_on_crash();
  // A rank worker stands for a user's program: it gets the same start-up CPU tuning.
  if (std::getenv("FSDP_TEST_WORKER") != nullptr) fsdp::dist::tune_cpu_or_reexec(argc, argv);
  const int worker_rc = fsdp::testing::maybe_run_worker();
  if (worker_rc >= 0) return worker_rc;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
