#pragma once
// SIGINT/SIGTERM for train_gpt: what a stop signal does depends on the phase the run is in.
//
//   stop_signal::install();                              // first thing in main(): kNothingToSave
//   ... parse, load data, build and initialise the model, load a checkpoint ...
//   stop_signal::set_phase(stop_signal::kTraining);      // once a step has finished
//   if (stop_signal::requested()) ...                    // polled at step / batch boundaries
//
// - kNothingToSave (argument parsing, data loading, model construction, materialisation and
//   initialisation, checkpoint loading, the first step): the handler itself writes one line and
//   calls _exit(128 + signal) at once; nothing is lost, as no state worth saving exists yet.
// - kDeferred (a short critical section, e.g. rewriting the metrics file): the signal is recorded;
//   leaving the section for kNothingToSave exits then.
// - kTraining (after the first step): the signal is recorded; the ranks agree on it at the next
//   step boundary, validation batch or sampled token, save a checkpoint and exit 0.
// A second signal exits at once in every phase (status 128 + signal, no checkpoint).
// The handler is async-signal-safe: lock-free atomics, write(2) and _exit(2) only.
namespace train_gpt::stop_signal {

enum Phase : int { kNothingToSave = 0, kDeferred = 1, kTraining = 2 };

void install();
// Entering kNothingToSave with a signal already recorded exits at once.
void set_phase(Phase phase);
// A stop signal arrived in this process (in kDeferred or kTraining). Ranks must still agree.
bool requested();

// RAII: kDeferred for a critical section, then back to the previous phase.
class Deferred {
 public:
  Deferred();
  ~Deferred();
  Deferred(const Deferred&) = delete;
  Deferred& operator=(const Deferred&) = delete;

 private:
  Phase previous_;
};

}  // namespace train_gpt::stop_signal
