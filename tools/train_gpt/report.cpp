#include "report.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include <ATen/Parallel.h>

#include "stop_signal.h"

namespace train_gpt {

namespace {

// "1.25 MB"
std::string megabytes(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

std::string format_duration(double s) {
  char buf[32];
  const long t = std::lround(s);
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  return buf;
}

Reporter::Reporter(const Options& options, bool rank0, int64_t start_step)
    : o_(options),
      active_(rank0),
      start_step_(start_step),
      tokens_per_step_(options.batch_size * options.seq_len),
      first_loss_(std::nan("")),
      last_loss_(std::nan("")),
      last_val_(std::nan("")),
      t_train_(now_s()),
      t_print_(now_s() - 3600) {}

void Reporter::banner(const BannerInfo& info) {
  if (!active_) return;
  const Options& o = o_;
  const double share = 100.0 * static_cast<double>(info.local_params) / static_cast<double>(info.n_params);
  std::printf("train_gpt: %s, seq %lld: %.2fM parameters (%.0f%% on this rank)\n", info.model.c_str(),
              static_cast<long long>(o.seq_len), static_cast<double>(info.n_params) / 1e6, share);
  const std::string ep = o.ep_size > 1 ? " (dp " + std::to_string(info.world / o.ep_size) + " x ep " +
                                             std::to_string(o.ep_size) + ": expert parallel)"
                                       : "";
  std::printf("train_gpt: --parallel %s, %d rank%s%s x %d thread%s, %s, batch %lld x %lld tokens (grad-accum %lld)\n",
              o.parallel.c_str(), info.world, info.world > 1 ? "s" : "", ep.c_str(), info.threads,
              info.threads > 1 ? "s" : "", o.mixed_precision.c_str(), static_cast<long long>(o.batch_size),
              static_cast<long long>(o.seq_len), static_cast<long long>(o.grad_accum));
  std::printf("train_gpt: data %s\n", info.data.c_str());
  if (!info.offload.empty()) std::printf("train_gpt: %s\n", info.offload.c_str());
  const bool resumed = o.resume || info.resumed_dir;
  if (resumed) {
    std::printf("train_gpt: %s\n", info.resumed_dir
                                       ? ("resumed " + *info.resumed_dir + " at step " + std::to_string(start_step_) +
                                          (info.resume_note.empty() ? "" : " (" + info.resume_note + ")"))
                                             .c_str()
                                       : ("no checkpoint in " + o.checkpoint_dir + ": starting from scratch").c_str());
  }
  if (!o.metrics.empty()) {
    stop_signal::Deferred rewriting;  // a signal now would cut the rewritten file short
    metrics_.open(o.metrics, resumed, start_step_);
    std::printf("train_gpt: metrics -> %s\n", o.metrics.c_str());
  }
  if (!o.checkpoint_dir.empty() && !o.eval_only)
    std::printf("train_gpt: checkpoints -> %s/step_NNNNNN\n", o.checkpoint_dir.c_str());
  std::fflush(stdout);
  t_train_ = now_s();
}

void Reporter::step(const StepReport& s) {
  if (!active_) return;
  if (std::isnan(first_loss_)) first_loss_ = s.loss;
  last_loss_ = s.loss;
  if (s.val_loss) last_val_ = *s.val_loss;
  const double tps = static_cast<double>(tokens_per_step_) / s.step_time_s;
  nlohmann::json line = {{"step", s.step},
                         {"loss", s.loss},
                         {"lr", s.lr},
                         {"grad_norm", s.grad_norm},
                         {"step_time_s", s.step_time_s},
                         {"tokens_per_s", tps},
                         {"comm_bytes", s.comm_bytes},
                         {"param_bytes", s.param_bytes},
                         {"grad_bytes", s.grad_bytes},
                         {"optim_bytes", s.optim_bytes},
                         {"peak_rss_bytes", s.peak_rss_bytes},
                         {"max_peak_rss_bytes", s.max_peak_rss_bytes}};
  if (s.val_loss) line["val_loss"] = *s.val_loss;
  if (s.aux_loss) line["aux_loss"] = *s.aux_loss;
  if (s.expert_load) {
    line["expert_load_min"] = s.expert_load->first;
    line["expert_load_max"] = s.expert_load->second;
  }
  if (s.all_to_all_bytes) line["all_to_all_bytes"] = *s.all_to_all_bytes;
  line["tokens_seen"] = s.step * tokens_per_step_;
  if (s.data_position) {
    line["data_epoch"] = s.data_position->epoch;
    line["data_index"] = s.data_position->index;
  }
  metrics_.step(line);
  if (now_s() - t_print_ < 2.0 && s.step != start_step_ + 1 && s.step != o_.steps && !s.val_loss) return;
  t_print_ = now_s();
  const double elapsed = now_s() - t_train_;
  const double eta = elapsed / static_cast<double>(s.step - start_step_) * static_cast<double>(o_.steps - s.step);
  std::string memory;
  for (size_t i = 0; i < s.rss_bytes.size(); ++i) {
    if (i) memory.push_back('/');
    memory.append(std::to_string(s.rss_bytes[i] / 1000000));
  }
  char router[128] = "";  // "  aux 1.0312  load 40-88" (--model moe), "  a2a 1.25 MB" (--ep-size)
  if (s.aux_loss && s.expert_load)
    std::snprintf(router, sizeof router, "  aux %.4f  load %lld-%lld%s", *s.aux_loss,
                  static_cast<long long>(s.expert_load->first), static_cast<long long>(s.expert_load->second),
                  s.all_to_all_bytes ? ("  a2a " + megabytes(*s.all_to_all_bytes)).c_str() : "");
  std::printf("step %5lld/%lld  loss %.4f%s%s  lr %.2e  %6.0f tok/s  %.3f s/step  ETA %s  mem %s MB\n",
              static_cast<long long>(s.step), static_cast<long long>(o_.steps), s.loss,
              s.val_loss ? ("  val " + std::to_string(*s.val_loss).substr(0, 6)).c_str() : "", router, s.lr, tps,
              s.step_time_s, format_duration(eta).c_str(), memory.c_str());
  std::fflush(stdout);
}

void Reporter::evaluation(int64_t step, std::optional<double> val_loss) {
  if (!active_) return;
  if (!val_loss) {
    std::printf("train_gpt: validation stopped by a signal\n");
    std::fflush(stdout);
    return;
  }
  const int64_t tokens = o_.eval_batches * o_.batch_size * o_.seq_len;
  std::printf("val %.6f  (%lld batches x %lld x %lld tokens from the start of the validation data, step %lld)\n",
              *val_loss, static_cast<long long>(o_.eval_batches), static_cast<long long>(o_.batch_size),
              static_cast<long long>(o_.seq_len), static_cast<long long>(step));
  metrics_.write_line({{"step", step},
                       {"val_loss", *val_loss},
                       {"eval_batches", o_.eval_batches},
                       {"eval_tokens", tokens},
                       {"eval_only", true}});
  std::fflush(stdout);
}

void Reporter::checkpoint_saved(int64_t step, const std::string& dir, double seconds,
                                const std::vector<std::string>& removed) {
  if (!active_) return;
  std::printf("checkpoint: step %lld -> %s (%.2f s)\n", static_cast<long long>(step), dir.c_str(), seconds);
  for (const auto& gone : removed)
    std::printf("checkpoint: removed %s (--keep-checkpoints %lld)\n", gone.c_str(),
                static_cast<long long>(o_.keep_checkpoints));
  std::fflush(stdout);
}

void Reporter::finish(int64_t step, int world, bool stopped, const std::string& last_saved, const std::string& sample) {
  if (!active_) return;
  if (stopped) {
    std::printf("train_gpt: stopped by a signal after step %lld/%lld%s\n", static_cast<long long>(step),
                static_cast<long long>(o_.steps),
                last_saved.empty() ? "" : ("; resume with --resume (" + last_saved + ")").c_str());
  } else if (!sample.empty()) {
    std::printf("---- sample (prompt|generated) ----\n%s\n-----------------------------------\n", sample.c_str());
  }
  metrics_.summary({{"steps", step},
                    {"world_size", world},
                    {"tokens_per_step", tokens_per_step_},
                    {"parallel", o_.parallel},
                    {"first_loss", first_loss_},
                    {"final_loss", last_loss_},
                    {"final_val_loss", last_val_}});
  if (!std::isnan(first_loss_)) {
    std::printf("train_gpt: loss %.4f -> %.4f over steps %lld..%lld in %s\n", first_loss_, last_loss_,
                static_cast<long long>(start_step_ + 1), static_cast<long long>(step),
                format_duration(now_s() - t_train_).c_str());
  }
  std::fflush(stdout);
}

}  // namespace train_gpt
