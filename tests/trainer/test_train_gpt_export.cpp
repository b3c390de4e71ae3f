// Nothing lost at the Hugging Face edges of train_gpt and fsdp-ckpt (models/llama/hf.h): an
// --export-hf destination that is the --init-from folder (or reaches it through a symlink), holds
// someone's files, is read-only or lies under a file is refused at start, before any training, in
// one line with exit status 2, every file there byte-identical; a re-export replaces an earlier
// export; fsdp-ckpt export-hf refuses the same before reading the checkpoint. Model folders: a
// FIFO at config.json, model.safetensors, the index or a shard is refused within seconds (never
// opened), NaN weights are refused on every rank unless --allow-nonfinite-weights, and a shape
// mismatch exits 2 as docs/llama-hf.md says.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <set>

#include "folder_bytes.h"
#include "train_gpt_harness.h"

using namespace train_gpt_test;
using fsdp::testing::folder_bytes;
using fsdp::testing::names_in;

namespace {

const std::string kFsdpCkpt = FSDP_CKPT_PATH;

// One "<program>: error: ..." line, exit status 2, nothing trained.
void expect_one_line_error(const ProcessResult& r, const std::string& program, const std::string& needle) {
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count(r.output, program + ": error: "), 1u) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "want '" << needle << "' in:\n" << r.output;
  EXPECT_EQ(count(r.output, "\n"), 1u) << "one line expected:\n" << r.output;
  EXPECT_FALSE(trained(r.output)) << r.output;
}

// Refused when the weights are read (after the model is built: the memory line may come first):
// exit status 2, one error line, nothing trained.
void expect_refused_at_load(const ProcessResult& r, const std::string& needle) {
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: error: "), 1u) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "want '" << needle << "' in:\n" << r.output;
  const auto error = r.output.find("train_gpt: error: ");
  EXPECT_EQ(r.output.find('\n', error), r.output.size() - 1) << "the error is not one last line:\n" << r.output;
  EXPECT_FALSE(trained(r.output)) << r.output;
}

// Two ranks refusing the same input: every error line is that refusal (no rank hangs or blames the
// connection to its peer), nothing trained. Each rank checks on its own, so the first to exit can
// get the other stopped by fsdprun before it prints: one refusal or two.
void expect_every_rank_refuses(const ProcessResult& r, const std::string& needle) {
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  const size_t errors = count(r.output, "train_gpt: error: ");
  EXPECT_GE(errors, 1u) << r.output;
  EXPECT_LE(errors, 2u) << r.output;
  EXPECT_EQ(count(r.output, needle), errors) << "want '" << needle << "' in every error line of:\n" << r.output;
  EXPECT_EQ(r.output.find("Connection closed"), std::string::npos) << r.output;
  EXPECT_FALSE(trained(r.output)) << r.output;
}

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// `from`'s model.safetensors with `edit` applied, into `to` (a copy of the folder).
void rewrite_weights(const std::string& from, const fs::path& to,
                     const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
  fs::copy(from, to);
  std::map<std::string, at::Tensor> tensors;
  {
    fsdp::safetensors::Reader r((to / "model.safetensors").string());
    for (const auto& e : r.header().tensors) tensors[e.name] = r.read(e.name);
  }
  edit(tensors);
  std::vector<fsdp::safetensors::NamedTensor> out;
  for (auto& [name, t] : tensors) out.push_back({name, t});
  fs::remove(to / "model.safetensors");
  fsdp::safetensors::write_file((to / "model.safetensors").string(), out, {{"format", "pt"}});
}

}  // namespace

// Each refused destination: one line, exit 2, before any training; every file byte-identical.
TEST(TrainGptExport, DestinationRefusedAtStartAndLeftUntouched) {
  TempDir tmp, metrics_dir;
  const std::string t = tmp.path, m = metrics_dir.path + "/m.jsonl";
  const std::string init = t + "/init";
  fs::copy(fixture("llama_tied_bf16"), init);  // holds generation_config.json: copied along by an export
  fs::create_directories(t + "/notes");
  write_text(t + "/notes/notes.txt", "mine");
  write_text(t + "/notes/model.safetensors.index.json", "{}");
  write_text(t + "/file", "a file");
  fs::create_directory_symlink(t, t + "/link");
  const auto before = folder_bytes(t);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {init, "--export-hf " + init + ": is the --init-from folder " + init},
      {t + "/link/init", "--export-hf " + t + "/link/init: is the --init-from folder"},
      {t + "/notes", "--export-hf " + t + "/notes: holds files an export does not write ('"},
      {t + "/file", "--export-hf " + t + "/file: exists and is not a folder"},
      {t + "/file/sub", "--export-hf " + t + "/file/sub: lies under " + t + "/file, which is not a folder"},
  };
  for (const auto& [out, needle] : cases) {
    SCOPED_TRACE(out);
    expect_one_line_error(alone(from_folder(init, m, {"--export-hf", out}), 60s), "train_gpt", needle);
  }
  expect_every_rank_refuses(ranks(2, from_folder(init, m, {"--export-hf", init}), 60s), "is the --init-from folder");
  EXPECT_EQ(folder_bytes(t), before);
  EXPECT_EQ(names_in(t), (std::set<std::string>{"init", "notes", "file", "link"}));
  EXPECT_FALSE(fs::exists(m)) << "training started";
}

// A destination whose parent cannot be written in is refused at start, by every rank: a read-only
// folder, or (as root, whom permissions do not stop) sysfs, which refuses root a new folder too.
TEST(TrainGptExport, UnwritableDestinationRefusedAtStart) {
  TempDir tmp;
  const bool root = ::geteuid() == 0;
  const std::string parent = root ? "/sys" : tmp.path + "/ro";
  if (root && ::mkdir("/sys/fsdp_export_probe", 0755) == 0) {
    ::rmdir("/sys/fsdp_export_probe");
    GTEST_SKIP() << "/sys is writable here: no folder refuses root";
  }
  if (!root) {
    fs::create_directories(parent);
    fs::permissions(parent, fs::perms::owner_read | fs::perms::owner_exec);
  }
  const auto a = alone(from_folder(fixture("qwen2"), "", {"--export-hf", parent + "/hf"}), 60s);
  const auto b = ranks(2, from_folder(fixture("qwen2"), "", {"--export-hf", parent + "/hf"}), 60s);
  const auto c = alone(from_folder(fixture("qwen2"), "", {"--export-hf", parent}), 60s);
  if (!root) fs::permissions(parent, fs::perms::owner_all);
  expect_one_line_error(a, "train_gpt", "--export-hf " + parent + "/hf: cannot write in its parent folder " + parent);
  expect_every_rank_refuses(b, "cannot write in its parent folder " + parent);
  // The read-only folder itself (it may not be replaced), or sysfs's non-empty root.
  expect_one_line_error(c, "train_gpt", "--export-hf " + parent + ": ");
  EXPECT_FALSE(fs::exists(parent + "/hf"));
}

// A second run exporting to the same folder replaces the first export (the marker says it is
// ours); fsdp-ckpt export-hf replaces it too; nothing else appears next to it.
TEST(TrainGptExport, ReExportReplacesAnEarlierExport) {
  TempDir tmp;
  const std::string out = tmp.path + "/hf", ck = tmp.path + "/ck", m = tmp.path + "/m.jsonl";
  const auto a = alone(from_folder(fixture("qwen2"), m, {"--export-hf", out}));
  ASSERT_TRUE(a.ok()) << a.output;
  ASSERT_TRUE(fs::exists(out + "/.fsdp-export"));
  const auto first = folder_bytes(out);
  const auto b =
      ranks(2, from_folder(fixture("qwen2"), m, {"--export-hf", out, "--steps", "3", "--checkpoint-dir", ck}));
  ASSERT_TRUE(b.ok()) << b.output;
  const auto second = folder_bytes(out);
  EXPECT_NE(first.at("model.safetensors"), second.at("model.safetensors")) << "the export was not replaced";
  const auto e = run_process(spec_of({kFsdpCkpt, "export-hf", ck + "/step_000003", out, "--dtype", "bf16"}, 60s));
  ASSERT_TRUE(e.ok()) << e.output;
  EXPECT_NE(folder_bytes(out).at("config.json").find("bfloat16"), std::string::npos);
  EXPECT_EQ(names_in(tmp.path), (std::set<std::string>{"hf", "ck", "m.jsonl"}));
}

// fsdp-ckpt export-hf checks OUT before it reads the checkpoint (here: one that does not exist).
TEST(TrainGptExport, FsdpCkptRefusesTheDestinationBeforeReading) {
  TempDir tmp;
  const std::string notes = tmp.path + "/notes";
  fs::create_directories(notes);
  write_text(notes + "/config.json", "{\"mine\": true}");
  const auto before = folder_bytes(tmp.path);
  const auto e = run_process(spec_of({kFsdpCkpt, "export-hf", tmp.path + "/absent", notes}, 60s));
  expect_one_line_error(e, "fsdp-ckpt", notes + ": holds a Hugging Face folder that is not an export of ours");
  EXPECT_EQ(folder_bytes(tmp.path), before);
}

// A FIFO where train_gpt --init-from reads a file: refused in one line within seconds (the 30 s
// timeout fails the test if open() blocks).
TEST(TrainGptExport, FifoInAModelFolderIsRefusedWithinSeconds) {
  TempDir tmp;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"qwen2", "config.json"},
      {"qwen2", "model.safetensors"},
      {"llama_untied_sharded", "model.safetensors.index.json"},
      {"llama_untied_sharded", "model-00003-of-00005.safetensors"},
      {"qwen2", "generation_config.json"},  // copied along by --export-hf: checked at start
  };
  int i = 0;
  for (const auto& [name, file] : cases) {
    SCOPED_TRACE(file);
    const fs::path dir = tmp.path + "/f" + std::to_string(i++);
    fs::copy(fixture(name), dir);
    fs::remove(dir / file);
    ASSERT_EQ(::mkfifo((dir / file).c_str(), 0644), 0);
    const auto r = alone(from_folder(dir.string(), "", {"--export-hf", tmp.path + "/out"}), 30s);
    expect_one_line_error(r, "train_gpt", (dir / file).string() + ": is a FIFO (named pipe), not a regular file");
  }
  EXPECT_FALSE(fs::exists(tmp.path + "/out"));
}

// NaN in the weights: refused naming the tensor (at 2 ranks by both, though only rank 1 holds the
// bad row), trained as they are with --allow-nonfinite-weights.
TEST(TrainGptExport, NonFiniteWeightsRefusedUnlessAllowed) {
  TempDir tmp;
  const fs::path bad = tmp.path + "/nan";
  rewrite_weights(fixture("qwen2"), bad, [](auto& t) { t["model.layers.0.mlp.up_proj.weight"][-1][0] = std::nan(""); });
  const std::string needle = "'model.layers.0.mlp.up_proj.weight' holds NaN or Inf values";
  expect_refused_at_load(alone(from_folder(bad.string(), ""), 60s), needle);
  expect_every_rank_refuses(ranks(2, from_folder(bad.string(), ""), 60s), needle);
  auto args = from_folder(bad.string(), "");
  args.push_back("--allow-nonfinite-weights");
  const auto r = alone(args, 60s);
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_TRUE(trained(r.output)) << r.output;
}

// A weight whose shape does not fit config.json is bad input: exit 2, one line (it was 1).
TEST(TrainGptExport, ShapeMismatchExitsTwo) {
  TempDir tmp;
  const fs::path bad = tmp.path + "/shape";
  rewrite_weights(fixture("qwen2"), bad, [](auto& t) { t["model.norm.weight"] = at::ones({31}); });
  expect_refused_at_load(alone(from_folder(bad.string(), ""), 60s),
                         "'model.norm.weight' has shape [31] but the model expects [32]");
}
