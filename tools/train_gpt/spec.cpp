#include "spec.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "fsdp/checkpoint/inspect.h"

namespace train_gpt {

namespace fs = std::filesystem;

namespace {

// "llama (LlamaForCausalLM, MistralForCausalLM)": the specs that read Hugging Face folders.
std::string hf_models() {
  std::string out;
  for (const auto& spec : model_specs()) {
    if (spec.hf_architectures.empty()) continue;
    std::string archs;
    for (const auto& a : spec.hf_architectures) archs += (archs.empty() ? "" : ", ") + a;
    out += (out.empty() ? "" : "; ") + spec.name + " (" + archs + ")";
  }
  return out;
}

// config.json's single "architectures" value; throws std::invalid_argument naming `source`.
std::string architecture_of(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": not valid JSON: " + e.what());
  }
  const auto it = j.is_object() ? j.find("architectures") : j.end();
  if (it == j.end() || !it->is_array() || it->size() != 1 || !(*it)[0].is_string())
    throw std::invalid_argument(source + ": expected one architecture, e.g. \"architectures\": [\"LlamaForCausalLM\"]");
  return (*it)[0].get<std::string>();
}

// Stat only, never open: a FIFO would block. False when `path` does not exist.
bool regular_file(const fs::path& path) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!fs::exists(st)) return false;
  if (fs::is_regular_file(st)) return true;
  const std::string kind = st.type() == fs::file_type::fifo        ? "a FIFO (named pipe)"
                           : st.type() == fs::file_type::directory ? "a folder"
                           : st.type() == fs::file_type::socket    ? "a socket"
                                                                   : "a device or special file";
  throw std::invalid_argument(path.string() + ": is " + kind +
                              ", not a regular file; a model folder holds regular files (or symlinks to them): "
                              "replace it");
}

const ModelSpec* spec_reading(const std::string& architecture) {
  for (const auto& spec : model_specs())
    for (const auto& a : spec.hf_architectures)
      if (a == architecture) return &spec;
  return nullptr;
}

}  // namespace

void TrainModel::read_init_from(Options& o) {
  throw std::invalid_argument("--init-from loads a Hugging Face model; --model " + o.model +
                              " has none (drop --init-from; the architectures: " + hf_models() + ")");
}

void TrainModel::load_weights(const Options& o) {
  throw std::invalid_argument("--model " + o.model + " cannot load --init-from weights");
}

void TrainModel::export_hf(const Options& o) {
  throw std::invalid_argument("--export-hf writes a Hugging Face folder; --model " + o.model +
                              " has no Hugging Face architecture (use one of: " + hf_models() + ")");
}

void TrainModel::apply_ep(const fsdp::DeviceMesh& mesh) {
  throw std::invalid_argument("--ep-size " + std::to_string(mesh.size("ep")) +
                              ": this model has no experts (expert parallelism is for --model moe or --init-from a "
                              "mixture-of-experts folder)");
}

std::map<std::string, std::vector<int64_t>> TrainModel::parameter_shapes() const {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : module()->named_parameters()) shapes[p.key()] = p.value().sizes().vec();
  return shapes;
}

const std::vector<ModelSpec>& model_specs() {
  static const std::vector<ModelSpec> specs = {gpt_spec(), llama_spec(), moe_spec()};  // one line per architecture
  return specs;
}

const ModelSpec& model_spec(const std::string& name) {
  std::string names;
  for (const auto& spec : model_specs()) {
    if (spec.name == name) return spec;
    names += (names.empty() ? "" : ", ") + spec.name;
  }
  throw std::invalid_argument("--model " + name + " is not an architecture of this trainer (" + names + ")");
}

const ModelSpec& spec_for_init_from(const Options& o) {
  const std::string& dir = o.init_from;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw std::invalid_argument("--init-from " + dir + ": " +
                                (fs::exists(dir, ec) ? "not a folder" : "no such folder") +
                                " (give a Hugging Face model folder: config.json and model.safetensors or its index)");
  const fs::path config = fs::path(dir) / "config.json";
  if (!regular_file(config))
    throw std::invalid_argument("--init-from " + dir +
                                ": no config.json (a Hugging Face model folder holds config.json and the weights)");
  std::ifstream in(config, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) throw std::invalid_argument("--init-from: cannot read " + config.string());
  const std::string arch = architecture_of(text.str(), "--init-from: " + config.string());
  const ModelSpec* spec = spec_reading(arch);
  if (!spec)
    throw std::invalid_argument("--init-from: " + config.string() + "'s architecture '" + arch +
                                "' is not one this trainer reads: " + hf_models());
  if (o.model_given && o.model != spec->name)
    throw std::invalid_argument("--init-from " + dir + " holds a " + arch + " (--model " + spec->name +
                                "): drop --model " + o.model);
  return *spec;
}

std::optional<RecordedModel> recorded_model(const std::string& dir) {
  fsdp::checkpoint::CheckpointReader reader(dir);
  for (const auto& spec : model_specs()) {
    const std::string key = "extra." + spec.record_entry + ".config_json";
    if (!reader.info().find(key)) continue;
    const at::Tensor bytes = reader.read(key).to(at::kByte).contiguous();
    RecordedModel r{&spec, std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                                       static_cast<size_t>(bytes.numel()))};
    if (spec.hf_architectures.empty()) return r;
    const std::string arch = architecture_of(r.json, "checkpoint " + dir + " (its recorded config.json)");
    r.spec = spec_reading(arch);
    if (!r.spec)
      throw std::invalid_argument("checkpoint " + dir + " records a " + arch +
                                  ", an architecture this build does not read: " + hf_models());
    return r;
  }
  return std::nullopt;
}

}  // namespace train_gpt
