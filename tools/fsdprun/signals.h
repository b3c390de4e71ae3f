#pragma once
// Signals as events in the poll loop (signalfd), not as asynchronous handlers.
//
// install() blocks SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGCHLD in the calling thread; it must run first
// thing in main(), before c10d's TCPStore starts its threads, so that every thread inherits the
// mask and no signal lands on a thread that cannot act on it. Workers get a clean mask back.
#include <csignal>
#include <string>

namespace fsdprun {

class Signals {
 public:
  static Signals& install();
  static Signals& get();

  int fd() const { return fd_; }
  // Reads everything pending on fd(). Termination signals are counted; SIGCHLD only wakes the loop.
  void drain();
  // The first termination signal received (0: none yet), and how many arrived in total.
  int termination() const { return first_term_; }
  int termination_count() const { return term_count_; }
  // The set blocked in fsdprun (workers unblock it before exec).
  static const sigset_t& blocked();

 private:
  Signals() = default;
  int fd_ = -1;
  int first_term_ = 0;
  int term_count_ = 0;
};

// "SIGTERM", "SIGKILL", ...
std::string signal_name(int sig);

}  // namespace fsdprun
