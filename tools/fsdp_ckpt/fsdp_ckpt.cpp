// fsdp-ckpt: a command for checkpoint folders written by fsdp::checkpoint::save (train_gpt's
// step_NNNNNN folders), needing no model code. A thin layer over fsdp/checkpoint/inspect.h:
//
//   fsdp-ckpt describe DIR              step, world size and layout saved, tensors, sizes
//   fsdp-ckpt verify DIR                every checksum; names the first bad file and tensor
//   fsdp-ckpt consolidate DIR OUT [--max-shard-size 5GB] [--all]   one safetensors file or a
//                                       Hugging Face sharded index, one tensor in memory at a time
//   fsdp-ckpt diff DIR1 DIR2 [--atol X] per-tensor max absolute difference
//   fsdp-ckpt export-hf DIR OUT [--dtype fp32|bf16] [--max-shard-size 5GB]   a checkpoint
//                                       as a Hugging Face folder (the architecture it records: spec.h)
//
// Exit status: 0 success (verify: intact; diff: no tensor differs beyond --atol), 1 the
// checkpoint is damaged or unreadable (verify, describe, consolidate) or the checkpoints differ
// (diff), 2 a bad command line, or (diff) a checkpoint that cannot be read, or (export-hf) a
// checkpoint with no Hugging Face architecture (a GPT's) or an OUT that may not be written (the
// checkpoint folder, someone's files, a path under a file: refused before anything is read).
// export-hf writes OUT as train_gpt --export-hf does: into a temporary folder next to it, renamed
// into place once complete; an earlier export there is replaced only then (exit 1 if writing
// fails: OUT is left as it was).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "fsdp/checkpoint/inspect.h"
#include "fsdp/checkpoint/safetensors.h"
#include "models/llama/hf.h"
#include "spec.h"

namespace {

namespace ckpt = fsdp::checkpoint;

constexpr int kOk = 0, kFailed = 1, kUsage = 2;

std::string human_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

// "rank3" for the library's data-<id>-rank00003.safetensors, else the file name.
std::string file_label(const std::string& file) {
  static const std::regex data_file("data-[0-9a-f]{16}-rank0*([0-9]+)\\.safetensors");
  std::smatch m;
  return std::regex_match(file, m, data_file) ? "rank" + m[1].str() : file;
}

// "whole" or "[0:192, :]" per chunk, with the file that holds it.
std::string layout_text(const ckpt::TensorInfo& t) {
  if (t.chunks.size() == 1) return "whole in " + file_label(t.chunks[0].file);
  std::string out;
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const auto& c = t.chunks[i];
    out += i ? "  " : "";
    out += "[";
    for (size_t d = 0; d < t.shape.size(); ++d) {
      out += d ? ", " : "";
      out += c.offsets[d] == 0 && c.sizes[d] == t.shape[d]
                 ? std::string(":")
                 : std::to_string(c.offsets[d]) + ":" + std::to_string(c.offsets[d] + c.sizes[d]);
    }
    out += "] " + file_label(c.file);
  }
  return out;
}

// "5GB" (10^9), "5GiB" (2^30), "500M", "1000": bytes. Throws CLI::ValidationError.
uint64_t parse_size(const std::string& text) {
  static const std::regex pattern("\\s*([0-9]+(\\.[0-9]+)?)\\s*([KMGT]?)(i?)B?\\s*", std::regex::icase);
  std::smatch m;
  if (!std::regex_match(text, m, pattern))
    throw CLI::ValidationError("--max-shard-size", "'" + text + "' is not a size (e.g. 5GB, 500MB, 2GiB, 1000000)");
  const double value = std::stod(m[1].str());
  const std::string unit = m[3].str();
  const double base = m[4].str().empty() ? 1000.0 : 1024.0;
  int power = 0;
  if (!unit.empty()) power = 1 + static_cast<int>(std::string("KMGT").find(static_cast<char>(std::toupper(unit[0]))));
  const double bytes = value * std::pow(base, power);
  if (bytes < 1 || bytes > 1e18) throw CLI::ValidationError("--max-shard-size", "'" + text + "' is out of range");
  return static_cast<uint64_t>(bytes);
}

// The values of scalar Stateful entries ("extra.trainer.step" = 600), for describe.
std::map<std::string, std::string> scalar_extras(ckpt::CheckpointReader& reader) {
  std::map<std::string, std::string> out;
  for (const auto& t : reader.info().tensors) {
    if (t.key.rfind("extra.", 0) != 0 || t.bytes > 8 || !(t.shape.empty() || (t.shape.size() == 1 && t.shape[0] == 1)))
      continue;
    const at::Tensor v = reader.read(t.key);
    char buf[64];
    if (at::isFloatingType(v.scalar_type()))
      std::snprintf(buf, sizeof buf, "%g", v.item<double>());
    else
      std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v.item<int64_t>()));
    out[t.key.substr(6)] = buf;
  }
  return out;
}

int describe(const std::string& dir) {
  ckpt::CheckpointReader reader(dir);
  const ckpt::CheckpointInfo& info = reader.info();
  uint64_t on_disk = 0;
  for (const auto& [file, bytes] : info.file_bytes) on_disk += bytes;
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("  saved by %d rank%s (save id %s), %zu data file%s, %s on disk\n", info.world_size,
              info.world_size == 1 ? "" : "s", info.save_id.c_str(), info.files.size(),
              info.files.size() == 1 ? "" : "s", human_bytes(on_disk).c_str());
  for (const auto& file : info.files)
    if (!info.file_bytes.count(file)) std::printf("  MISSING data file %s\n", file.c_str());
  const auto extras = scalar_extras(reader);
  for (const auto& [key, value] : extras)
    if (key.size() >= 5 && key.compare(key.size() - 5, 5, ".step") == 0)
      std::printf("  step %s (extra.%s)\n", value.c_str(), key.c_str());
  if (!info.extras.empty()) {
    std::string line;
    for (const auto& name : info.extras) line += (line.empty() ? "" : ", ") + name;
    std::printf("  extras: %s\n", line.c_str());
    for (const auto& [key, value] : extras) std::printf("    %s = %s\n", key.c_str(), value.c_str());
  }
  // Per key group (model., optim., extra.): tensors, elements, bytes; and how they are laid out.
  struct Group {
    int tensors = 0;
    uint64_t elements = 0, bytes = 0;
  };
  std::map<std::string, Group> groups;
  int sharded = 0, whole = 0;
  size_t key_width = 3;
  for (const auto& t : info.tensors) {
    auto& g = groups[t.key.substr(0, t.key.find('.'))];
    g.tensors += 1;
    g.bytes += t.bytes;
    uint64_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
    g.elements += n;
    (t.chunks.size() > 1 ? sharded : whole) += 1;
    key_width = std::max(key_width, t.key.size());
  }
  std::printf("  tensors: %zu (", info.tensors.size());
  bool first = true;
  for (const auto& [name, g] : groups) {
    std::printf("%s%s %d: %llu elements, %s", first ? "" : "; ", name.c_str(), g.tensors,
                static_cast<unsigned long long>(g.elements), human_bytes(g.bytes).c_str());
    first = false;
  }
  std::printf(")\n  layout: %d tensor%s split over files, %d whole in one file\n\n", sharded, sharded == 1 ? "" : "s",
              whole);
  const int w = static_cast<int>(key_width);
  std::printf("  %-*s  %-5s  %-16s  %10s  %s\n", w, "key", "dtype", "shape", "size", "layout (chunk: box, file)");
  for (const auto& t : info.tensors)
    std::printf("  %-*s  %-5s  %-16s  %10s  %s\n", w, t.key.c_str(), t.dtype.c_str(), ckpt::shape_text(t.shape).c_str(),
                human_bytes(t.bytes).c_str(), layout_text(t).c_str());
  return kOk;
}

int verify(const std::string& dir, bool quiet) {
  ckpt::VerifyOptions options;
  const ckpt::VerifyReport report = ckpt::verify_checkpoint(dir, options);
  if (report.ok()) {
    std::printf("fsdp-ckpt: %s is intact: %d tensors, %s checked against their CRC-32s\n", dir.c_str(),
                report.tensors_checked, human_bytes(report.bytes_checked).c_str());
    return kOk;
  }
  const auto& first = report.problems.front();
  std::printf("fsdp-ckpt: %s is damaged: %zu problem%s; the first in file %s, tensor '%s'\n", dir.c_str(),
              report.problems.size(), report.problems.size() == 1 ? "" : "s", first.file.c_str(),
              first.key.empty() ? "(none: the whole file)" : first.key.c_str());
  if (!quiet)
    for (const auto& p : report.problems) std::printf("  %s\n", p.text().c_str());
  return kFailed;
}

// Prints one "wrote FILE (SIZE)" line per file; returns their total size.
uint64_t print_written(const std::vector<std::string>& written) {
  uint64_t total = 0;
  for (const auto& file : written) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(file, ec);
    total += ec ? 0 : size;
    std::printf("wrote %s (%s)\n", file.c_str(), human_bytes(ec ? 0 : size).c_str());
  }
  return total;
}

int consolidate(const std::string& dir, const std::string& out, const std::string& max_shard_size, bool all) {
  ckpt::ConsolidateOptions options;
  options.all_tensors = all;
  if (!max_shard_size.empty()) options.max_shard_bytes = parse_size(max_shard_size);
  const auto written = ckpt::consolidate_checkpoint(dir, out, options);
  const uint64_t total = print_written(written);
  std::printf("fsdp-ckpt: consolidated %s into %zu file%s, %s\n", dir.c_str(), written.size(),
              written.size() == 1 ? "" : "s", human_bytes(total).c_str());
  return kOk;
}

int diff(const std::string& a, const std::string& b, double atol, bool all) {
  ckpt::DiffOptions options;
  options.atol = atol;
  ckpt::DiffReport report;
  try {
    report = ckpt::diff_checkpoints(a, b, options);
  } catch (const ckpt::CheckpointError& e) {
    std::fprintf(stderr, "fsdp-ckpt: error: %s\n", e.what());
    return kUsage;  // diff(1)'s convention: 2 is trouble
  }
  double max_diff = 0;
  for (const auto& d : report.tensors) {
    if (d.mismatch.empty()) max_diff = std::max(max_diff, d.max_abs_diff);
    if (!d.differs && !all) continue;
    if (!d.mismatch.empty())
      std::printf("  %-8s %s: %s\n", "DIFFERS", d.key.c_str(), d.mismatch.c_str());
    else
      std::printf("  %-8s %s: max |a-b| = %.6g\n", d.differs ? "DIFFERS" : "same", d.key.c_str(), d.max_abs_diff);
  }
  std::printf("fsdp-ckpt: %d of %zu tensors differ (max |a-b| %.6g over the common tensors, --atol %g)\n",
              report.differing, report.tensors.size(), max_diff, atol);
  return report.same() ? kOk : kFailed;
}

// The architecture comes from what the checkpoint records (train_gpt's spec registry, spec.h):
// its spec writes the folder, or says it has no Hugging Face form.
int export_hf(const std::string& dir, const std::string& out, const std::string& dtype,
              const std::string& max_shard_size) {
  train_gpt::HFExportOptions options;
  options.bf16 = dtype == "bf16";
  if (!max_shard_size.empty()) options.max_shard_bytes = parse_size(max_shard_size);
  try {
    fsdp::models::check_hf_export_dir(out);  // the destination first: refused before reading anything
  } catch (const fsdp::models::HFError& e) {
    std::fprintf(stderr, "fsdp-ckpt: error: %s\n", e.what());
    return kUsage;
  }
  std::optional<train_gpt::RecordedModel> recorded;
  try {
    recorded = train_gpt::recorded_model(dir);
  } catch (const std::invalid_argument& e) {  // a record no architecture of this build reads: a usage error
    std::fprintf(stderr, "fsdp-ckpt: error: %s\n", e.what());
    return kUsage;
  }
  std::vector<std::string> written;
  try {
    if (!recorded || !recorded->spec->export_checkpoint)
      throw fsdp::models::HFError(
          "checkpoint " + dir + " records " +
          (recorded ? "a model of train_gpt --model " + recorded->spec->name + ", which has"
                    : std::string("no model: it has")) +
          " no Hugging Face architecture (export-hf takes a checkpoint of an architecture read from a Hugging Face "
          "folder, e.g. train_gpt --init-from)");
    written = recorded->spec->export_checkpoint(dir, out, options);
  } catch (const fsdp::models::HFError& e) {  // no Hugging Face architecture, or OUT refused: a usage error
    std::fprintf(stderr, "fsdp-ckpt: error: %s\n", e.what());
    return kUsage;
  }
  const uint64_t total = print_written(written);
  std::printf("fsdp-ckpt: exported %s as a Hugging Face folder %s (%s), %zu files, %s\n", dir.c_str(), out.c_str(),
              dtype.c_str(), written.size(), human_bytes(total).c_str());
  return kOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-ckpt: inspect, verify, consolidate and compare checkpoint folders written by fsdp::checkpoint::save\n"
      "(e.g. train_gpt's runs/train_gpt/checkpoints/step_NNNNNN). Needs no model code.\n"
      "Exit status: 0 success (verify: intact; diff: same within --atol), 1 damaged or unreadable checkpoint\n"
      "(describe, verify, consolidate) or checkpoints that differ (diff), 2 a bad command line or (diff) a\n"
      "checkpoint that cannot be read.",
      "fsdp-ckpt"};
  app.require_subcommand(1);
  std::string dir, dir_b, out, max_shard_size;
  bool quiet = false, all = false, all_tensors = false;
  double atol = 0;
  auto* describe_cmd =
      app.add_subcommand("describe", "step, world size and layout saved, tensors with shapes, dtypes and sizes");
  describe_cmd->add_option("DIR", dir, "checkpoint folder (holds index.json)")->required();
  auto* verify_cmd =
      app.add_subcommand("verify", "check every byte against its CRC-32; exit 1 naming the first bad file and tensor");
  verify_cmd->add_option("DIR", dir, "checkpoint folder")->required();
  verify_cmd->add_flag("-q,--quiet", quiet, "only the verdict line");
  auto* consolidate_cmd = app.add_subcommand(
      "consolidate", "write the full tensors to one safetensors file (or a Hugging Face sharded index), streaming");
  consolidate_cmd->add_option("DIR", dir, "checkpoint folder")->required();
  consolidate_cmd->add_option("OUT", out, "output file, e.g. out/model.safetensors")->required();
  consolidate_cmd->add_option("--max-shard-size", max_shard_size,
                              "split into files of at most this size (5GB, 500MB, 2GiB, bytes): "
                              "OUT's stem-0000i-of-0000N.safetensors + OUT.index.json");
  consolidate_cmd->add_flag("--all", all_tensors,
                            "every tensor (optimizer state, extras) under its checkpoint key; default: the model's "
                            "tensors, named as export_safetensors names them");
  auto* diff_cmd =
      app.add_subcommand("diff", "per-tensor max absolute difference; exit 0 same, 1 different, 2 trouble");
  diff_cmd->add_option("DIR1", dir, "checkpoint folder A")->required();
  diff_cmd->add_option("DIR2", dir_b, "checkpoint folder B")->required();
  diff_cmd->add_option("--atol", atol, "differences up to this count as equal (default 0: bit-equal values)")
      ->check(CLI::NonNegativeNumber);
  diff_cmd->add_flag("--all", all, "list every tensor, not only those that differ");
  std::string dtype = "fp32";
  auto* export_cmd = app.add_subcommand(
      "export-hf",
      "a checkpoint of a train_gpt run whose architecture has a Hugging Face form (--model llama, --init-from: "
      "found from the model the checkpoint records) as a Hugging Face folder: config.json, model.safetensors or "
      "model-0000k-of-0000n.safetensors + index, streaming");
  export_cmd->add_option("DIR", dir, "checkpoint folder")->required();
  export_cmd
      ->add_option("OUT", out,
                   "output folder: new, empty, or an earlier export (replaced once the new one is complete)")
      ->required();
  export_cmd->add_option("--dtype", dtype, "fp32 | bf16: the files' dtype")->check(CLI::IsMember({"fp32", "bf16"}));
  export_cmd->add_option("--max-shard-size", max_shard_size,
                         "split into files of at most this size (5GB, 500MB, 2GiB, bytes; default 5GB)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    for (auto& c : msg)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "fsdp-ckpt: error: %s (see fsdp-ckpt --help)\n", msg.c_str());
    return kUsage;
  }
  try {
    if (*describe_cmd) return describe(dir);
    if (*verify_cmd) return verify(dir, quiet);
    if (*consolidate_cmd) return consolidate(dir, out, max_shard_size, all_tensors);
    if (*diff_cmd) return diff(dir, dir_b, atol, all);
    if (*export_cmd) return export_hf(dir, out, dtype, max_shard_size);
  } catch (const CLI::ValidationError& e) {
    std::fprintf(stderr, "fsdp-ckpt: error: %s (see fsdp-ckpt --help)\n", e.what());
    return kUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-ckpt: error: %s\n", e.what());
    return kFailed;
  }
  return kUsage;
}
