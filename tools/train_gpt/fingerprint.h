#pragma once
// The configuration fingerprint: the options every rank must share, compared once the process
// group has formed, so that ranks started with different options all fail within seconds with
// one line naming the option, instead of a Gloo abort, a collective timeout or (for --seed)
// ranks that silently train inconsistent models.
//
//   fsdp::dist::init_distributed();
//   check_same_options_on_every_rank(*fsdp::dist::world_comm(), options);   // every rank
//
// Protocol (two collectives at most, the same on every rank): each rank hashes each option's
// value (FNV-1a 64) and all-gathers the fixed-size vector of hashes; every rank then knows which
// options differ. Only when some do, the values of the first few differing options (fixed-size,
// truncated) are all-gathered too, so that the message can show them; then every rank throws
// std::invalid_argument.
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/comm.h"
#include "options.h"

namespace train_gpt {

// (option name, value as text) for every option that must agree across ranks, in a fixed order.
// Not in it: --metrics (rank 0 writes it alone). --data is compared by its path.
std::vector<std::pair<std::string, std::string>> rank_agreed_options(const Options& o);

// Throws std::invalid_argument on every rank when the ranks' options differ, e.g.
// "the ranks were started with different options: --seed is '1' on rank 0 and '2' on rank 1
// (every rank must get the same command line)".
void check_same_options_on_every_rank(fsdp::comm::Comm& comm, const Options& o);

}  // namespace train_gpt
