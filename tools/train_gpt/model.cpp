#include "model.h"

#include <cstring>
#include <stdexcept>
#include <utility>

namespace train_gpt {

std::map<std::string, at::Tensor> ConfigRecord::state_dict() const {
  at::Tensor bytes = at::empty({static_cast<int64_t>(json.size())}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>(), json.data(), json.size());
  return {{"config_json", bytes}};
}

void ConfigRecord::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  auto it = state.find("config_json");
  if (it == state.end()) return;
  const at::Tensor bytes = it->second.to(at::kCPU, at::kByte).contiguous();
  json.assign(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
}

void check_resume_model(const std::string& dir, const Options& o, const TrainModel& model) {
  const std::optional<RecordedModel> recorded = recorded_model(dir);
  if (!recorded) return;  // an older checkpoint: the shape check decides
  const ModelIdentity there = recorded->spec->make()->recorded_identity(recorded->json, "checkpoint " + dir);
  ModelIdentity here = model.identity(o);
  here.text +=
      !o.init_from.empty() ? " from --init-from " + o.init_from : " (--model " + o.model + " and its size options)";
  std::string field;
  if (there.kind == here.kind) {
    for (size_t k = 0; k < here.fields.size() && k < there.fields.size() && field.empty(); ++k) {
      if (here.fields[k].second != there.fields[k].second)
        field =
            " (" + here.fields[k].first + " " + there.fields[k].second + " there, " + here.fields[k].second + " here)";
    }
    if (field.empty()) return;
  }
  throw std::invalid_argument("checkpoint " + dir + " holds another model than this run's: it holds " + there.text +
                              ", this run builds " + here.text + field +
                              "; a resume never changes the model: resume with the --model, --init-from or size "
                              "options it was trained with, or give another --checkpoint-dir");
}

}  // namespace train_gpt
