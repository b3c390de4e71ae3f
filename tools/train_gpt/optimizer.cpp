#include "optimizer.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <stdexcept>

#include "fsdp/checkpoint/optimizer_state.h"
#include "fsdp/optim/fused.h"

namespace train_gpt {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Options& o, const std::vector<at::Tensor>& params) {
  namespace optim = torch::optim;
  const auto adamw = optim::AdamWOptions(o.lr).betas({0.9, 0.95}).weight_decay(o.weight_decay);
  const auto adam = optim::AdamOptions(o.lr).betas({0.9, 0.95});
  const auto sgd = optim::SGDOptions(o.lr).momentum(0.9);
  if (o.optimizer == "adamw") return std::make_unique<optim::AdamW>(params, adamw);
  if (o.optimizer == "adam") return std::make_unique<optim::Adam>(params, adam);
  if (o.optimizer == "sgd") return std::make_unique<optim::SGD>(params, sgd);
  if (o.optimizer == "fused-adamw") return std::make_unique<fsdp::optim::FusedAdamW>(params, adamw);
  if (o.optimizer == "fused-adam") return std::make_unique<fsdp::optim::FusedAdam>(params, adam);
  if (o.optimizer == "fused-sgd") return std::make_unique<fsdp::optim::FusedSGD>(params, sgd);
  if (o.optimizer == "adagrad") return std::make_unique<optim::Adagrad>(params, optim::AdagradOptions(o.lr));
  if (o.optimizer == "rmsprop") return std::make_unique<optim::RMSprop>(params, optim::RMSpropOptions(o.lr));
  throw std::invalid_argument("--optimizer " + o.optimizer +
                              " is not one of adamw, adam, sgd, adagrad, rmsprop, fused-adamw, fused-adam, fused-sgd");
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

int64_t optimizer_state_bytes(torch::optim::Optimizer& opt) {
  const auto& codec = fsdp::checkpoint::optimizer_codec(opt);
  int64_t n = 0;
  for (auto& [key, state] : opt.state()) {
    for (const auto& field : codec.fields) {
      if (!field.like_param) {
        n += static_cast<int64_t>(sizeof(int64_t));
        continue;
      }
      const at::Tensor t = field.get(*state);
      if (t.defined()) n += t.numel() * static_cast<int64_t>(t.element_size());
    }
  }
  return n;
}

}  // namespace train_gpt
