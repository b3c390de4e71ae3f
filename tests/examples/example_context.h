#pragma once
// The names an `Example:` block in a public header may use without declaring them: a model, one
// of its blocks, an optimizer, some tensors. The examples are compiled (and linked) by the build
// (tests/examples/CMakeLists.txt), never run, so these are only declarations with the right types.
//
//   model       fsdp::models::GPT (a ModuleHolder: model->blocks, *model, model.ptr())
//   block       fsdp::models::Block, one of model->blocks
//   config      fsdp::models::GPTConfig;  GPT, GPTConfig, GPTImpl, BlockImpl are in scope;
//               namespaces ckpt (fsdp::checkpoint) and tp (fsdp::tp)
//   optimizer   torch::optim::AdamW (also `opt`)
//   tokens, targets, x, loss   at::Tensor
//   fn          at::Tensor(const at::Tensor&): a function to checkpoint
//   step        int64_t
//   use(...), fail(message)   stand-ins for the caller's own code
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <string>

#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace fsdp_header_examples {

namespace ckpt = fsdp::checkpoint;
namespace tp = fsdp::tp;
using fsdp::models::BlockImpl;
using fsdp::models::GPTImpl;
using fsdp::models::GPT;
using fsdp::models::GPTConfig;

struct ExampleContext {
  GPTConfig config;
  GPT model{nullptr};
  fsdp::models::Block block{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer;
  at::Tensor tokens, targets, x, loss;
  std::function<at::Tensor(const at::Tensor&)> fn;
};

template <typename... T>
void use(T&&...) {}
[[noreturn]] inline void fail(const std::string& message) { throw std::runtime_error(message); }

}  // namespace fsdp_header_examples

// Opens an example's scope: the context's names as locals (an example may shadow them).
#define FSDP_EXAMPLE_CONTEXT(ctx)                                     \
  [[maybe_unused]] GPTConfig& config = (ctx).config;                  \
  [[maybe_unused]] GPT& model = (ctx).model;                          \
  [[maybe_unused]] auto& block = (ctx).block;                         \
  [[maybe_unused]] torch::optim::AdamW& optimizer = *(ctx).optimizer; \
  [[maybe_unused]] torch::optim::AdamW& opt = *(ctx).optimizer;       \
  [[maybe_unused]] at::Tensor& tokens = (ctx).tokens;                 \
  [[maybe_unused]] at::Tensor& targets = (ctx).targets;               \
  [[maybe_unused]] at::Tensor& x = (ctx).x;                           \
  [[maybe_unused]] at::Tensor& loss = (ctx).loss;                     \
  [[maybe_unused]] auto& fn = (ctx).fn;                               \
  [[maybe_unused]] int64_t step = 0
