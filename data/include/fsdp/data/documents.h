#pragma once
// The documents of a corpus file, as fsdp-tokenize and train_gpt --data text:FILE read them: in a
// text file, runs of lines separated by blank lines; in a JSON-lines file (.jsonl, .json,
// .ndjson), the string field of each non-blank line.
//
// Example:
//   fsdp::data::read_documents("web.jsonl", [&](fsdp::data::RawDocument&& d, int64_t bytes_read) {
//     std::string text = fsdp::data::document_text(d, "text");   // throws DataError: one line
//   });
#include <cstdint>
#include <functional>
#include <string>

namespace fsdp::data {

// A document as read: its text, or (JSON lines) the line, parsed later by document_text (so that
// the threads of fsdp-tokenize parse in parallel).
struct RawDocument {
  std::string raw;
  bool json = false;
  std::string where;  // "file" or "file:line", for messages
};

// .jsonl, .json and .ndjson files hold JSON lines; anything else is text.
bool is_json_lines(const std::string& path);

// Calls `sink` with each document of `path` in order, and the bytes of the file read so far.
// Throws DataError when the file cannot be opened.
void read_documents(const std::string& path, const std::function<void(RawDocument&&, int64_t)>& sink);

// The document's text: `raw` itself, or the string `field` of its JSON line. Throws DataError
// ("web.jsonl:3: not JSON (...)", "web.jsonl:3: no string field "text" (give --field NAME)").
std::string document_text(const RawDocument& doc, const std::string& field);

}  // namespace fsdp::data
