// The module-hook registry (fsdp/hooks/forward_hooks.h) through fsdp::call and fsdp::call_method:
// order by HookOrder then registration, pre rewriting the arguments and post the outputs, abort
// when forward throws, removal, and entries dropped with their module.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "fsdp/fsdp.h"

namespace {

using fsdp::hooks::ForwardHooks;
using fsdp::hooks::HookOrder;

struct ThrowingImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    if (x.sum().item<double>() < 0) throw std::runtime_error("negative");
    return x + 1;
  }
};
TORCH_MODULE(Throwing);

ForwardHooks tracing(HookOrder order, const std::string& name, std::vector<std::string>& log) {
  ForwardHooks h;
  h.order = order;
  h.pre = [name, &log](std::vector<at::Tensor> args) {
    log.push_back("pre " + name);
    return args;
  };
  h.post = [name, &log](std::vector<at::Tensor>&) { log.push_back("post " + name); };
  h.abort = [name, &log]() noexcept { log.push_back("abort " + name); };
  return h;
}

TEST(ForwardHooks, RunInOrderThenRegistrationAroundCallAndCallMethod) {
  Throwing m;
  std::vector<std::string> log;
  // Registered out of order: sharding first, tensor parallel second, two user hooks last.
  fsdp::hooks::register_forward_hooks(m.ptr(), tracing(HookOrder::kSharding, "fsdp", log));
  fsdp::hooks::register_forward_hooks(m.ptr(), tracing(HookOrder::kTensorParallel, "tp", log));
  fsdp::hooks::register_forward_hooks(m.ptr(), tracing(HookOrder::kUser, "user1", log));
  fsdp::hooks::register_forward_hooks(m.ptr(), tracing(HookOrder::kUser, "user2", log));
  const std::vector<std::string> want = {"pre user1",  "pre user2",  "pre tp",  "pre fsdp",
                                         "post user1", "post user2", "post tp", "post fsdp"};
  fsdp::call(m, at::ones({2}));
  EXPECT_EQ(log, want);
  log.clear();
  fsdp::call_method(m, &ThrowingImpl::forward, at::ones({2}));
  EXPECT_EQ(log, want);
  log.clear();
  // Forward throws: every hook whose pre ran is aborted, in reverse order; no post runs.
  EXPECT_THROW(fsdp::call(m, -at::ones({2})), std::runtime_error);
  EXPECT_EQ(log, (std::vector<std::string>{"pre user1", "pre user2", "pre tp", "pre fsdp", "abort fsdp", "abort tp",
                                           "abort user2", "abort user1"}));
  log.clear();
  fsdp::hooks::remove_forward_hooks(m.ptr().get(), HookOrder::kUser);
  fsdp::call(m, at::ones({2}));
  EXPECT_EQ(log, (std::vector<std::string>{"pre tp", "pre fsdp", "post tp", "post fsdp"}));
}

TEST(ForwardHooks, PreRewritesArgumentsAndPostRewritesOutputs) {
  torch::nn::Linear lin(3, 3);
  {
    torch::NoGradGuard no_grad;
    lin->weight.copy_(at::eye(3));
    lin->bias.zero_();
  }
  ForwardHooks h;
  h.pre = [](std::vector<at::Tensor> args) {
    args[0] = args[0] * 2;
    return args;
  };
  h.post = [](std::vector<at::Tensor>& outs) { outs[0] = outs[0] + 1; };
  fsdp::hooks::register_forward_hooks(lin.ptr(), std::move(h));
  const at::Tensor x = at::tensor({1.0f, 2.0f, 3.0f});
  EXPECT_TRUE(fsdp::call(lin, x).equal(x * 2 + 1));
  EXPECT_TRUE(lin(x).equal(x)) << "calling the module directly runs no hook";
}

TEST(ForwardHooks, AnEntryDiesWithItsModule) {
  std::vector<std::string> log;
  const torch::nn::Module* address = nullptr;
  {
    Throwing m;
    address = m.ptr().get();
    fsdp::hooks::register_forward_hooks(m.ptr(), tracing(HookOrder::kUser, "old", log));
    EXPECT_NE(fsdp::hooks::detail::find_forward_hooks(address), nullptr);
  }
  EXPECT_EQ(fsdp::hooks::detail::find_forward_hooks(address), nullptr);
}

}  // namespace
