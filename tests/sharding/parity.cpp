#include "parity.h"

#include <cmath>

#include "fsdp/fsdp.h"

namespace fsdp::testing {

models::GPTConfig uneven_config() {
  models::GPTConfig c;
  c.vocab_size = 67;
  c.block_size = 11;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 20;
  return c;
}

at::Tensor global_batch(const models::GPTConfig& c, int64_t batch, int step, int micro) {
  auto gen = at::detail::createCPUGenerator(1000 + 17 * step + micro);
  return at::randint(c.vocab_size, {batch, c.block_size + 1}, gen, at::kLong);
}

namespace {
// AdamW with eps 1e-3 rather than 1e-8. The attention's key bias has an exactly zero true
// gradient (softmax ignores a constant added to every score), so what it receives is rounding
// noise, and Adam with a tiny eps turns any noise into full-size steps: the single-process and the
// sharded run then move it differently (measured: 4e-4 relative, every other parameter < 6e-7).
// That is Adam amplifying noise, not a sharding error; eps 1e-3 keeps noise-driven steps tiny
// while real gradients still train.
torch::optim::AdamW make_optimizer(torch::nn::Module& model) {
  return torch::optim::AdamW(model.parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1).eps(1e-3));
}

models::GPT fresh_model(const models::GPTConfig& c) {
  torch::manual_seed(42);
  return models::GPT(c);
}
}  // namespace

TrainResult train_reference(const models::GPTConfig& c, int steps, int64_t batch, int micro_batches,
                            const std::function<void(models::GPT&)>& prepare) {
  auto model = fresh_model(c);
  if (prepare) prepare(model);
  auto opt = make_optimizer(*model);
  TrainResult r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    double loss_sum = 0;
    for (int m = 0; m < micro_batches; ++m) {
      auto data = global_batch(c, batch, s, m);
      auto logits = model->forward(data.narrow(1, 0, c.block_size));
      auto loss = models::gpt_loss(logits, data.narrow(1, 1, c.block_size)) / micro_batches;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    opt.step();
    r.losses.push_back(loss_sum);
  }
  for (const auto& p : model->named_parameters()) r.parameters[p.key()] = p.value().detach().clone();
  r.state_bytes = training_state_bytes(*model, opt);
  return r;
}

TrainResult train_sharded(const models::GPTConfig& c, int steps, int64_t batch, int micro_batches,
                          const ShardedRun& run) {
  auto world = fsdp::dist::world_comm();
  const int n = world->size(), rank = world->rank();
  TORCH_CHECK(batch % n == 0, "the global batch must split evenly");
  const int64_t local = batch / n;
  auto model = fresh_model(c);
  run.shard(model);
  auto opt = make_optimizer(*model);
  fsdp::check_optimizer_params(opt);
  TrainResult r;
  for (int s = 0; s < steps; ++s) {
    if (run.zero_grad)
      run.zero_grad(model);
    else
      opt.zero_grad();
    double loss_sum = 0;
    for (int m = 0; m < micro_batches; ++m) {
      if (run.before_micro_batch) run.before_micro_batch(m, micro_batches, model);
      auto data = global_batch(c, batch, s, m).narrow(0, rank * local, local);
      auto input = data.narrow(1, 0, c.block_size);
      auto logits = run.forward ? run.forward(model, input) : fsdp::call(model, input);
      auto loss = models::gpt_loss(logits, data.narrow(1, 1, c.block_size)) / micro_batches;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    opt.step();
    auto global_loss = at::tensor({loss_sum}, at::kDouble);
    world->all_reduce(global_loss, fsdp::comm::ReduceOp::Avg);
    r.losses.push_back(global_loss.item<double>());
  }
  r.state_bytes = training_state_bytes(*model, opt);
  r.model = model;
  return r;
}

double check_shards_match(models::GPT& model, const std::map<std::string, at::Tensor>& reference, double tolerance) {
  double worst = 0;
  for (const auto& p : model->named_parameters()) {
    auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, "parameter ", p.key(), " is not a shard");
    const at::Tensor& full = reference.at(p.key());
    TORCH_CHECK(full.sizes() == at::IntArrayRef(info->global_shape), p.key(), ": global shape mismatch");
    at::Tensor rows = full.dim() == 0 ? full.reshape({1}) : full;
    at::Tensor want = rows.narrow(info->shard_dim, info->dim0_offset, info->local_rows);
    // Relative difference, with magnitudes below 1 counted as 1: biases and LayerNorm shifts start
    // at zero, where a pure ratio would measure float32 rounding against nothing.
    const double diff =
        want.numel() ? ((p.value().detach() - want).abs() / want.abs().clamp_min(1.0)).max().item<double>() : 0.0;
    TORCH_CHECK(diff <= tolerance, "parameter ", p.key(), " differs from the single-process run by ", diff,
                " (relative), tolerance ", tolerance);
    worst = std::max(worst, diff);
  }
  return worst;
}

double check_full_params_match(models::GPT& model, const std::map<std::string, at::Tensor>& reference,
                               double tolerance) {
  double worst = 0;
  for (const auto& p : model->named_parameters()) {
    const at::Tensor& want = reference.at(p.key());
    TORCH_CHECK(p.value().sizes() == want.sizes(), p.key(), ": shape mismatch");
    const double diff = ((p.value().detach() - want).abs() / want.abs().clamp_min(1.0)).max().item<double>();
    TORCH_CHECK(diff <= tolerance, "parameter ", p.key(), " differs from the single-process run by ", diff,
                " (relative), tolerance ", tolerance);
    worst = std::max(worst, diff);
  }
  return worst;
}

void check_losses_match(const std::vector<double>& got, const std::vector<double>& want, double tolerance) {
  TORCH_CHECK(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double rel = std::abs(got[i] - want[i]) / std::abs(want[i]);
    TORCH_CHECK(rel <= tolerance, "step ", i, ": loss ", got[i], " vs single-process ", want[i], " (relative ", rel,
                ")");
  }
}

double training_state_bytes(torch::nn::Module& model, torch::optim::AdamW& optimizer) {
  double bytes = 0;
  for (const auto& p : model.parameters()) {
    bytes += static_cast<double>(p.nbytes());
    if (p.grad().defined()) bytes += static_cast<double>(p.grad().nbytes());
  }
  for (const auto& item : optimizer.state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*item.second);
    bytes += static_cast<double>(st.exp_avg().nbytes() + st.exp_avg_sq().nbytes());
    if (st.max_exp_avg_sq().defined()) bytes += static_cast<double>(st.max_exp_avg_sq().nbytes());
  }
  return bytes;
}

std::optional<int64_t> last_dim_of_matrices(const std::string& /*name*/, const at::Tensor& param) {
  return param.dim() >= 2 ? std::optional<int64_t>(-1) : std::nullopt;
}

models::GPT parity_model(const models::GPTConfig& c) { return fresh_model(c); }
torch::optim::AdamW parity_optimizer(torch::nn::Module& model) { return make_optimizer(model); }

}  // namespace fsdp::testing
