#pragma once
// The safetensors format's parser and checksum: the library's internals behind
// fsdp/checkpoint/safetensors.h's Reader and writers (and the checkpoint index's CRC-32s), with
// the tests and the fuzzer (tests/checkpoint/fuzz) as their other users. Not an API.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fsdp/checkpoint/safetensors.h"

namespace fsdp::safetensors {

// The format's upper bound on the JSON header (the reference implementation's MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Parses and validates a header. `bytes` holds the start of the file (at least 8 + N bytes, or
// the whole file when it is shorter); `file_size` is the whole file's size. Checks: the length
// prefix fits the file and kMaxHeaderBytes, valid UTF-8 JSON object, known dtypes, non-negative
// shapes without overflow, end - begin == numel * element size, offsets inside the buffer, sorted
// offsets contiguous from 0 with no overlap or hole, buffer size == file_size - data_start,
// no duplicate names, __metadata__ a string map. Throws SafetensorsError naming `source`.
Header parse_header(const uint8_t* bytes, size_t size, uint64_t file_size, const std::string& source = "<memory>");

// CRC-32 (zlib's polynomial) of a byte range, continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t length, uint32_t crc = 0);

}  // namespace fsdp::safetensors
