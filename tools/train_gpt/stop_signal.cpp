#include "stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace train_gpt::stop_signal {
namespace {

std::atomic<int> g_phase{kNothingToSave};
std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs lock-free atomics");

void say(const char* msg) {
  size_t n = 0;
  while (msg[n] != '\0') ++n;
  ssize_t ignored = ::write(STDERR_FILENO, msg, n);
  (void)ignored;
}

[[noreturn]] void exit_now(int sig, const char* why) {
  say(sig == SIGINT ? "train_gpt: SIGINT " : "train_gpt: SIGTERM ");
  say(why);
  ::_exit(128 + sig);
}

void on_signal(int sig) {
  if (g_signal.load() != 0) exit_now(sig, "again: exiting now without saving\n");
  if (g_phase.load() == kNothingToSave) exit_now(sig, "before the first step finished: nothing to save, exiting now\n");
  g_signal.store(sig);
}

}  // namespace

void install() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);  // one handler at a time
  sigaddset(&sa.sa_mask, SIGTERM);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

void set_phase(Phase phase) {
  g_phase.store(phase);
  if (phase == kNothingToSave) {
    if (const int sig = g_signal.load())
      exit_now(sig, "before the first step finished: nothing to save, exiting now\n");
  }
}

bool requested() { return g_signal.load() != 0; }

Deferred::Deferred() : previous_(static_cast<Phase>(g_phase.load())) {
  if (previous_ == kNothingToSave) g_phase.store(kDeferred);
}
Deferred::~Deferred() { set_phase(previous_); }

}  // namespace train_gpt::stop_signal
