#include "error_text.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace train_gpt {

std::string strip_backtrace(const std::string& message) {
  std::istringstream in(message);
  std::string line, out;
  bool in_trace = false;
  while (std::getline(in, line)) {
    if (line.rfind("Exception raised from ", 0) == 0) {
      in_trace = true;  // c10's "Exception raised from f at file:line (most recent call first):"
      continue;
    }
    if (in_trace && (line.rfind("frame #", 0) == 0 || line.empty() || line.rfind("<omitting", 0) == 0)) continue;
    in_trace = false;
    out += line;
    out += '\n';
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string error_text(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return strip_backtrace(c10->what_without_backtrace());
  return strip_backtrace(e.what());
}

}  // namespace train_gpt
