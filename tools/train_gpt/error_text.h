#pragma once
// The text train_gpt prints for an exception: the whole message (hints on later lines included,
// e.g. the collective timeout's advice naming FSDP_COLLECTIVE_TIMEOUT_S), without LibTorch's C++
// backtrace. A c10::Error gives what_without_backtrace(); in any message (a c10::Error's text is
// often wrapped in another exception's), the "Exception raised from ..." line and the
// "frame #N: ..." lines after it are dropped, as are blank lines at the end.
//
// Example: std::fprintf(stderr, "train_gpt: error: %s\n", error_text(e).c_str());
#include <exception>
#include <string>

namespace train_gpt {

std::string error_text(const std::exception& e);
// The same cleaning on a string (exposed for tests of the format).
std::string strip_backtrace(const std::string& message);

}  // namespace train_gpt
