#include "spec.h"

#include <stdexcept>

namespace train_gpt {

void TrainModel::read_init_from(Options& o) {
  throw std::invalid_argument("--init-from loads a Hugging Face model; --model " + o.model +
                              " has none (drop --init-from, or use --model llama)");
}

void TrainModel::load_weights(const Options& o) {
  throw std::invalid_argument("--model " + o.model + " cannot load --init-from weights");
}

void TrainModel::export_hf(const Options& o) {
  throw std::invalid_argument("--export-hf writes a Hugging Face folder; --model " + o.model +
                              " has no Hugging Face architecture (use --model llama or --init-from)");
}

const std::vector<ModelSpec>& model_specs() {
  static const std::vector<ModelSpec> specs = {gpt_spec(), llama_spec()};  // one line per architecture
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

}  // namespace train_gpt
