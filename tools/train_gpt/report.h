#pragma once
// Rank 0's output: the start-up banner, a progress line per step (at most every 2 s, and at the
// first and last steps and validations), one metrics-file line per step (metrics.h), checkpoint
// notes and the closing summary. Every method does nothing on the other ranks.
//
// Example:
//   Reporter report(options, rank == 0, start_step);
//   report.banner({...});
//   report.step({...});                       // once per optimizer step
//   report.finish(step, stopped, last_saved, sample_text);
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/data/token_shards.h"
#include "metrics.h"
#include "options.h"

namespace train_gpt {

struct BannerInfo {
  int world = 1;
  int threads = 1;
  int64_t n_params = 0;      // the whole model's
  int64_t local_params = 0;  // this rank's
  std::string data;          // TokenSource::describe()
  std::optional<std::string> resumed_dir;
  std::string model;        // the architecture's description (spec.h TrainModel::describe)
  std::string resume_note;  // added to the "resumed ..." line (e.g. the checkpoint wins over --init-from)
  std::string offload;      // --cpu-offload: where the shards are (a line of its own; "": none)
};

// One optimizer step, as the progress line and the metrics file report it.
struct StepReport {
  int64_t step = 0;  // steps completed
  double loss = 0;   // global mean
  double lr = 0;
  double grad_norm = 0;
  double step_time_s = 0;
  uint64_t comm_bytes = 0;
  int64_t param_bytes = 0, grad_bytes = 0, optim_bytes = 0;  // this rank's local tensors
  std::vector<int64_t> rss_bytes;                            // current, per rank
  int64_t peak_rss_bytes = 0;                                // rank 0
  int64_t max_peak_rss_bytes = 0;                            // over ranks
  std::optional<double> val_loss;
  std::optional<fsdp::data::Position> data_position;  // token shards: where the next step reads
  // Optional figures an architecture provides (spec.h TrainModel::step_stats; --model moe): the
  // router's auxiliary loss (global mean, as `loss`) and the expert load, tokens per expert summed
  // over the layers and the ranks: its minimum and maximum over the experts.
  std::optional<double> aux_loss;
  std::optional<std::pair<int64_t, int64_t>> expert_load;
  // --ep-size > 1: the bytes the ranks sent in all-to-alls this step (dispatch and combine, forward
  // and backward, and the tokens-per-expert counts), summed over the ranks.
  std::optional<uint64_t> all_to_all_bytes;
};

class Reporter {
 public:
  Reporter(const Options& options, bool rank0, int64_t start_step);
  // The run's description; opens the metrics file (a resumed run keeps the lines up to its step).
  void banner(const BannerInfo& info);
  void step(const StepReport& s);
  // --eval-only: "val <loss>" and the metrics line {"step", "val_loss", "eval_batches", "eval_tokens"}
  // (nullopt: a signal interrupted it, nothing is written).
  void evaluation(int64_t step, std::optional<double> val_loss);
  void checkpoint_saved(int64_t step, const std::string& dir, double seconds, const std::vector<std::string>& removed);
  // `sample`: the generated text ("" when none was sampled).
  void finish(int64_t step, int world, bool stopped, const std::string& last_saved, const std::string& sample);

 private:
  const Options& o_;
  bool active_;
  int64_t start_step_;
  int64_t tokens_per_step_;
  MetricsWriter metrics_;
  double first_loss_, last_loss_, last_val_;
  double t_train_, t_print_;  // seconds on the steady clock
};

// "3m05s", "1h02m".
std::string format_duration(double seconds);

}  // namespace train_gpt
