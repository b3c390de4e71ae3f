#include "signals.h"

#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fsdprun {
namespace {
Signals* g_signals = nullptr;

sigset_t make_blocked() {
  sigset_t s;
  sigemptyset(&s);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD}) sigaddset(&s, sig);
  return s;
}
}  // namespace

const sigset_t& Signals::blocked() {
  static const sigset_t s = make_blocked();
  return s;
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

Signals& Signals::install() {
  if (g_signals != nullptr) return *g_signals;
  if (pthread_sigmask(SIG_BLOCK, &blocked(), nullptr) != 0) throw std::runtime_error("pthread_sigmask failed");
  // A closed stdout/stderr must not kill fsdprun (it still has workers to stop).
  signal(SIGPIPE, SIG_IGN);
  auto* s = new Signals();  // lives until exit
  s->fd_ = signalfd(-1, &blocked(), SFD_NONBLOCK | SFD_CLOEXEC);
  if (s->fd_ < 0) throw std::runtime_error(std::string("signalfd failed: ") + std::strerror(errno));
  g_signals = s;
  return *s;
}

Signals& Signals::get() {
  if (g_signals == nullptr) throw std::logic_error("Signals::install() was not called");
  return *g_signals;
}

void Signals::drain() {
  signalfd_siginfo info;
  while (true) {
    ssize_t n = read(fd_, &info, sizeof(info));
    if (n != static_cast<ssize_t>(sizeof(info))) {
      if (n < 0 && errno == EINTR) continue;
      return;  // EAGAIN: nothing more pending
    }
    int sig = static_cast<int>(info.ssi_signo);
    if (sig == SIGCHLD) continue;
    if (first_term_ == 0) first_term_ = sig;
    ++term_count_;
  }
}

}  // namespace fsdprun
