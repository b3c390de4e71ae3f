// fsdp-ckpt on real train_gpt checkpoints (2 ranks under fsdprun), intact and damaged: every
// command's output and exit status, and consolidate's file against export_safetensors of the
// same model.
#include <algorithm>
#include <cstring>
#include <fstream>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/inspect.h"
#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/checkpoint/state_dict.h"
#include "models/gpt.h"
#include "train_gpt_harness.h"

namespace {

using namespace train_gpt_test;
namespace ckpt = fsdp::checkpoint;

const std::string kFsdpCkpt = FSDP_CKPT_PATH;

ProcessResult fsdp_ckpt(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {kFsdpCkpt};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(spec_of(argv, 120s));
}

// The tiny model of tiny() (2 layers, dim 32, 2 heads, seq 16), trained 6 steps on 2 ranks with
// a checkpoint every 3: step_000003 and step_000006. Made once for the whole suite.
class FsdpCkpt : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const auto r = ranks(2, tiny(*dir_ / "m.jsonl", {"--checkpoint-dir", *dir_ / "ckpt", "--checkpoint-every", "3"}));
    ASSERT_TRUE(r.ok()) << r.output;
    ASSERT_TRUE(ckpt::is_committed(step(3)) && ckpt::is_committed(step(6))) << r.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string step(int s) { return *dir_ / (s == 3 ? "ckpt/step_000003" : "ckpt/step_000006"); }
  // A copy of step_000006 that a test may damage.
  static std::string copy_of_last(const std::string& name) {
    const std::string to = *dir_ / name;
    fs::remove_all(to);
    fs::copy(step(6), to, fs::copy_options::recursive);
    return to;
  }
  static std::string rank_file(const std::string& dir, int rank) {
    for (const auto& f : ckpt::inspect_checkpoint(dir).files)
      if (f.find("rank0000" + std::to_string(rank)) != std::string::npos) return (fs::path(dir) / f).string();
    ADD_FAILURE() << "no rank " << rank << " file in " << dir;
    return "";
  }
  static fsdp::models::GPT tiny_model() {
    fsdp::models::GPTConfig c;
    c.vocab_size = 256;
    c.block_size = 16;
    c.n_layer = 2;
    c.n_head = 2;
    c.n_embd = 32;
    return fsdp::models::GPT(c);
  }
  static TempDir* dir_;
};
TempDir* FsdpCkpt::dir_ = nullptr;

// Flips one byte at `offset` of `path`.
void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

TEST_F(FsdpCkpt, DescribeShowsStepWorldSizeLayoutAndEveryTensor) {
  const auto r = fsdp_ckpt({"describe", step(6)});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("saved by 2 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("2 data files"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 6 (extra.trainer.step)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("trainer.seed = 0"), std::string::npos) << r.output;
  const auto info = ckpt::inspect_checkpoint(step(6));
  int sharded = 0;
  for (const auto& t : info.tensors) {
    std::string shape = "[";
    for (size_t i = 0; i < t.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(t.shape[i]);
    shape += "]";
    // One row per tensor: key, dtype, global shape.
    const std::regex row("\n  " + std::regex_replace(t.key, std::regex(R"([.\[\]])"), R"(\$&)") + " +" + t.dtype +
                         " +" + std::regex_replace(shape, std::regex(R"([\[\]])"), R"(\$&)"));
    EXPECT_TRUE(std::regex_search(r.output, row)) << t.key << " " << shape << "\n" << r.output;
    sharded += t.chunks.size() > 1 ? 1 : 0;
  }
  // The token embedding (256 x 32) is split by rows over the two ranks' files.
  EXPECT_NE(r.output.find("[0:128, :] rank0  [128:256, :] rank1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("layout: " + std::to_string(sharded) + " tensors split over files"), std::string::npos)
      << r.output;
  EXPECT_GT(sharded, 0);
}

TEST_F(FsdpCkpt, VerifyPassesAnIntactCheckpoint) {
  const auto r = fsdp_ckpt({"verify", step(6)});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto info = ckpt::inspect_checkpoint(step(6));
  EXPECT_NE(r.output.find("is intact: " + std::to_string(info.tensors.size()) + " tensors"), std::string::npos)
      << r.output;
}

TEST_F(FsdpCkpt, VerifyNamesTheFileAndTensorOfAFlippedByte) {
  const std::string dir = copy_of_last("flipped");
  const std::string file = rank_file(dir, 1);
  // A byte in the middle of the data of the file's largest tensor.
  const fsdp::safetensors::Reader reader(file);
  const auto& header = reader.header();
  const auto largest = std::max_element(header.tensors.begin(), header.tensors.end(),
                                        [](const auto& a, const auto& b) { return a.nbytes() < b.nbytes(); });
  const std::string key = largest->name;
  flip_byte(file, header.data_start + largest->begin + largest->nbytes() / 2);
  const auto r = fsdp_ckpt({"verify", dir});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const std::string name = fs::path(file).filename().string();
  EXPECT_NE(r.output.find("1 problem; the first in file " + name + ", tensor '" + key + "'"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("checksum mismatch"), std::string::npos) << r.output;
  // The other commands refuse it too, naming the file and the tensor.
  const auto c = fsdp_ckpt({"consolidate", "--all", dir, *dir_ / "flipped_out/model.safetensors"});
  EXPECT_EQ(c.exit_code, 1) << c.output;
  EXPECT_NE(c.output.find(name + ": checksum mismatch in '" + key + "'"), std::string::npos) << c.output;
  EXPECT_FALSE(fs::exists(*dir_ / "flipped_out/model.safetensors"));
  EXPECT_FALSE(fs::exists(*dir_ / "flipped_out/model.safetensors.tmp"));
}

TEST_F(FsdpCkpt, VerifyNamesATruncatedFile) {
  const std::string dir = copy_of_last("truncated");
  const std::string file = rank_file(dir, 0);
  fs::resize_file(file, fs::file_size(file) - 100);
  const auto r = fsdp_ckpt({"verify", dir});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const std::string name = fs::path(file).filename().string();
  EXPECT_NE(r.output.find("the first in file " + name + ", tensor '(none: the whole file)'"), std::string::npos)
      << r.output;
  // A missing file is named the same way.
  fs::remove(file);
  const auto m = fsdp_ckpt({"verify", dir});
  EXPECT_EQ(m.exit_code, 1) << m.output;
  EXPECT_NE(m.output.find(name + " is missing"), std::string::npos) << m.output;
}

TEST_F(FsdpCkpt, VerifyAndDescribeNameADamagedIndex) {
  const std::string dir = copy_of_last("bad_index");
  std::ofstream(fs::path(dir) / "index.json", std::ios::trunc) << "{\"format\": \"fsdp-checkpoint\", \"vers";
  const auto r = fsdp_ckpt({"verify", dir});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("the first in file index.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("is damaged or not a checkpoint index"), std::string::npos) << r.output;
  const auto d = fsdp_ckpt({"describe", dir});
  EXPECT_EQ(d.exit_code, 1) << d.output;
  EXPECT_NE(d.output.find("fsdp-ckpt: error: checkpoint: " + dir + "/index.json is damaged"), std::string::npos)
      << d.output;
  // An index whose chunks leave a gap: named by the tensor.
  const std::string gap = copy_of_last("gap_index");
  std::ifstream in(fs::path(gap) / "index.json");
  auto index = nlohmann::json::parse(in);
  in.close();
  auto& chunks = index["tensors"]["model.wte.weight"]["chunks"];
  ASSERT_EQ(chunks.size(), 2u) << index.dump();
  chunks[1]["offsets"][0] = chunks[1]["offsets"][0].get<int64_t>() + 1;  // format 2: a box per chunk
  std::ofstream(fs::path(gap) / "index.json", std::ios::trunc) << index.dump();
  const auto g = fsdp_ckpt({"verify", gap});
  EXPECT_EQ(g.exit_code, 1) << g.output;
  EXPECT_NE(g.output.find("the first in file index.json, tensor 'model.wte.weight'"), std::string::npos) << g.output;
}

TEST_F(FsdpCkpt, ConsolidateEqualsExportSafetensorsOfTheSameModel) {
  // The reference: the model loaded from the checkpoint in this process, exported by the library.
  auto model = tiny_model();
  ckpt::load(step(6), ckpt::State{model.ptr(), nullptr, {}},
             ckpt::LoadOptions{.strict = true, .load_optimizer = false});
  const std::string expected = *dir_ / "export/model.safetensors";
  ckpt::export_safetensors(*model, expected);

  const std::string out = *dir_ / "consolidated/model.safetensors";
  const auto r = fsdp_ckpt({"consolidate", step(6), out});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("consolidated " + step(6) + " into 1 file"), std::string::npos) << r.output;
  const fsdp::safetensors::Reader a(out), b(expected);
  ASSERT_EQ(a.header().tensors.size(), b.header().tensors.size());
  EXPECT_EQ(a.header().metadata, b.header().metadata);
  for (const auto& entry : b.header().tensors) {
    const at::Tensor x = a.read(entry.name), y = b.read(entry.name);  // throws when absent
    EXPECT_EQ(x.scalar_type(), y.scalar_type()) << entry.name;
    EXPECT_EQ(x.sizes(), y.sizes()) << entry.name;
    EXPECT_TRUE(at::equal(x, y)) << entry.name;
  }
  // (Not byte-equal: export writes the model's registration order, which the checkpoint does not
  // record; consolidate writes key order. Same names, dtypes, shapes, values and metadata.)

  // Split into Hugging Face shards: every tensor in the weight map, and the model loads from it.
  const std::string split = *dir_ / "split/model.safetensors";
  const auto s = fsdp_ckpt({"consolidate", step(6), split, "--max-shard-size", "40KB"});
  ASSERT_EQ(s.exit_code, 0) << s.output;
  std::ifstream in(split + ".index.json");
  ASSERT_TRUE(in) << s.output;
  const auto index = nlohmann::json::parse(in);
  EXPECT_EQ(index["weight_map"].size(), b.header().tensors.size());
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  EXPECT_GT(files.size(), 2u) << index.dump();
  for (const auto& f : files) {
    EXPECT_TRUE(f.find("model-0000") == 0 && f.find("-of-0000") != std::string::npos) << f;
    uint64_t bytes = 0;
    for (const auto& e : fsdp::safetensors::Reader((fs::path(split).parent_path() / f).string()).header().tensors)
      bytes += e.nbytes();
    EXPECT_TRUE(bytes <= 40000 ||
                fsdp::safetensors::Reader((fs::path(split).parent_path() / f).string()).header().tensors.size() == 1)
        << f << " holds " << bytes << " bytes";
  }
  auto reloaded = tiny_model();
  const auto result = ckpt::load_safetensors(*reloaded, split + ".index.json");
  EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty());
  for (const auto& p : model->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), reloaded->named_parameters()[p.key()])) << p.key();
}

TEST_F(FsdpCkpt, ConsolidateAllKeepsOptimizerStateUnderItsKeys) {
  const std::string out = *dir_ / "all/everything.safetensors";
  const auto r = fsdp_ckpt({"consolidate", "--all", step(6), out});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fsdp::safetensors::Reader reader(out);
  const auto info = ckpt::inspect_checkpoint(step(6));
  ASSERT_EQ(reader.header().tensors.size(), info.tensors.size());
  for (const auto& t : info.tensors)
    EXPECT_TRUE(at::equal(reader.read(t.key), ckpt::read_full_tensor(step(6), t.key))) << t.key;
  EXPECT_EQ(reader.read("extra.trainer.step").item<int64_t>(), 6);
}

TEST_F(FsdpCkpt, DiffReportsPerTensorMaxAbsoluteDifference) {
  const auto same = fsdp_ckpt({"diff", step(6), copy_of_last("same")});
  EXPECT_EQ(same.exit_code, 0) << same.output;
  const auto info = ckpt::inspect_checkpoint(step(6));
  EXPECT_NE(same.output.find("0 of " + std::to_string(info.tensors.size()) + " tensors differ"), std::string::npos)
      << same.output;

  const auto r = fsdp_ckpt({"diff", step(3), step(6)});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("DIFFERS  extra.trainer.step: max |a-b| = 3\n"), std::string::npos) << r.output;
  // Each model tensor's figure is the max |a - b| of the full tensors.
  for (const std::string key : {"model.wte.weight", "model.lm_head.weight"}) {
    const at::Tensor a = ckpt::read_full_tensor(step(3), key), b = ckpt::read_full_tensor(step(6), key);
    const double expected = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
    char line[160];
    std::snprintf(line, sizeof line, "DIFFERS  %s: max |a-b| = %.6g\n", key.c_str(), expected);
    EXPECT_GT(expected, 0);
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  }
  const auto loose = fsdp_ckpt({"diff", "--atol", "1000", step(3), step(6)});
  EXPECT_EQ(loose.exit_code, 0) << loose.output;
  const auto trouble = fsdp_ckpt({"diff", step(6), *dir_ / "no_such_checkpoint"});
  EXPECT_EQ(trouble.exit_code, 2) << trouble.output;
  EXPECT_NE(trouble.output.find("no committed checkpoint"), std::string::npos) << trouble.output;
}

TEST_F(FsdpCkpt, BadCommandLinesExitTwoWithOneLine) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{},
                                               {"frobnicate"},
                                               {"verify"},
                                               {"consolidate", "x", "y", "--max-shard-size", "lots"}}) {
    const auto r = fsdp_ckpt(args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(count(r.output, "\n"), 1u) << r.output;
    EXPECT_NE(r.output.find("fsdp-ckpt: error: "), std::string::npos) << r.output;
  }
  const auto help = fsdp_ckpt({"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("Exit status"), std::string::npos) << help.output;
}

}  // namespace
