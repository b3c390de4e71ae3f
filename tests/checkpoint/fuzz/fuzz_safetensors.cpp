// libFuzzer target for the safetensors header parser: the whole input is treated as a file.
// parse_header must either accept it or throw SafetensorsError; any other exception escapes and
// libFuzzer reports it, as it does crashes and sanitizer findings. Built and run by
// scripts/fuzz-safetensors.sh; its corpus is replayed by test_safetensors (SafetensorsCorpus).
#include "checkpoint/safetensors_format.h"  // the parser and crc32 (src/: internals)

#include <cstddef>
#include <cstdint>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace st = fsdp::safetensors;
  try {
    st::Header h = st::parse_header(data, size, size, "fuzz");
    // Accepted headers must be internally consistent: what the loader will rely on.
    uint64_t expected = 0;
    for (const auto& t : h.tensors) {
      if (h.find(t.name) != &t) std::abort();  // names are unique
      if (t.begin != expected || t.end < t.begin) std::abort();
      if (static_cast<uint64_t>(t.numel()) * c10::elementSize(t.dtype) != t.nbytes()) std::abort();
      expected = t.end;
    }
    if (h.data_start + expected != size) std::abort();
  } catch (const st::SafetensorsError&) {
    // the expected way to reject an input
  }
  return 0;
}
