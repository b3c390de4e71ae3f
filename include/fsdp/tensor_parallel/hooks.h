#pragma once
// Where tensor parallel's communication runs: forward hooks, through fsdp::call.
//
// [Note: TP communication through fsdp::call]
// PyTorch's parallel styles insert their communication with forward pre-hooks and forward hooks.
// LibTorch modules have neither, and torch::nn::LinearImpl::forward is not virtual, so a style
// cannot wrap the module itself. parallelize_module therefore registers each style's input and
// output transforms as forward hooks of the module (fsdp/hooks/forward_hooks.h, order
// kTensorParallel), which fsdp::call(module, args...) and fsdp::call_method run: the input
// transforms on the tensor arguments before FSDP's pre-forward (PyTorch registers TP hooks first,
// at parallelize time), the output transforms on the output tensors after forward and before
// FSDP's post-forward (so a reshard comes after the output collective). A module with TP styles
// must therefore be called as `fsdp::call(q, x)`, not `q(x)`: calling it directly computes with
// the local shard and skips the collectives (for an unparallelised module fsdp::call is exactly
// forward, so one model source serves every layout). The transforms are autograd functions
// (comm_functions.h), so backward runs their conjugates; under activation checkpointing the
// recompute runs them again, on every rank alike.
#include "fsdp/hooks/forward_hooks.h"
