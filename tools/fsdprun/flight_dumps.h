#pragma once
// The flight recorder's folder (fsdp/debug/flight_recorder.h): --flight-recorder-dir sets
// FSDP_FLIGHT_RECORDER_DIR for the workers; when a worker fails, fsdprun prints one line saying
// where the ranks' dumps are and how to analyse them.
#include <string>

namespace fsdprun {

// `dir` made absolute (the workers and the printed line name the same folder whatever their
// working directory).
std::string flight_recorder_dir_for_workers(const std::string& dir);

// The line printed after a worker failed, e.g. "flight recorder: 2 dumps in /x/fr (rank_0.jsonl,
// rank_1.jsonl); line the ranks up with: fsdp-fr /x/fr" or "flight recorder: no dump in /x/fr
// (no collective failed or timed out on this node)".
std::string flight_recorder_note(const std::string& dir);

}  // namespace fsdprun
