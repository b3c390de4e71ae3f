#include "fsdp/data/documents.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "fsdp/data/token_shards.h"

namespace fsdp::data {

bool is_json_lines(const std::string& path) {
  const std::string ext = std::filesystem::path(path).extension().string();
  return ext == ".jsonl" || ext == ".json" || ext == ".ndjson";
}

void read_documents(const std::string& path, const std::function<void(RawDocument&&, int64_t)>& sink) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw DataError("cannot read input '" + path + "'");
  const bool json = is_json_lines(path);
  std::string line, doc;
  bool in_doc = false;
  int64_t line_no = 0, read_bytes = 0;
  while (std::getline(f, line)) {
    ++line_no;
    read_bytes += static_cast<int64_t>(line.size()) + 1;
    if (json) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines between records
      sink({line, true, path + ":" + std::to_string(line_no)}, read_bytes);
    } else if (line.empty()) {
      if (in_doc) sink({std::move(doc), false, path}, read_bytes);
      doc.clear();
      in_doc = false;
    } else {
      if (in_doc) doc.push_back('\n');
      doc += line;
      in_doc = true;
    }
  }
  if (in_doc) sink({std::move(doc), false, path}, read_bytes);
}

std::string document_text(const RawDocument& doc, const std::string& field) {
  if (!doc.json) return doc.raw;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(doc.raw);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(doc.where + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains(field) || !j[field].is_string()) {
    throw DataError(doc.where + ": no string field \"" + field + "\" (give --field NAME)");
  }
  return j[field].get<std::string>();
}

}  // namespace fsdp::data
