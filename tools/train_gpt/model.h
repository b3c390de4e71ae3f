#pragma once
// What a checkpoint records of its model, and the resume check against it: architecture-neutral
// (the architectures' own parts are spec.h's TrainModel::identity, recorded_identity and
// checkpoint_record).
//
// Example (a spec's checkpoint_record, and the trainer before allocating):
//   return {spec.record_entry, std::make_shared<ConfigRecord>(config_json)};
//   check_resume_model(dir, o, *model);
#include <map>
#include <string>

#include "fsdp/checkpoint/checkpoint.h"
#include "options.h"
#include "spec.h"

namespace train_gpt {

// A model's configuration as JSON text, saved as the uint8 tensor "config_json" of its Stateful
// entry (checkpoint key "extra.<entry>.config_json"), e.g. the GPT's {"model_type": "gpt",
// "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "block_size": 16}.
class ConfigRecord : public fsdp::checkpoint::Stateful {
 public:
  ConfigRecord() = default;
  explicit ConfigRecord(std::string json) : json(std::move(json)) {}
  std::map<std::string, at::Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, at::Tensor>& state) override;
  std::string json;
};

// A resume never changes the model: throws std::invalid_argument (one line, exit status 2) when
// the checkpoint `dir` records another model than `model` (configured) builds, naming both and the
// first field that differs (each spec leaves out the fields that shape no weight). A checkpoint
// that records no model (saved before the record existed) is left to the shape check. Reads
// index.json and one small tensor: run it before anything is allocated.
void check_resume_model(const std::string& dir, const Options& o, const TrainModel& model);

}  // namespace train_gpt
