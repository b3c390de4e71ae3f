// train_gpt: the reference trainer. An architecture of spec.h's registry (--model: the byte-level
// GPT, or a Llama-family decoder from scratch or from a Hugging Face folder with --init-from),
// trained with FSDP2's recipe in torchtitan's shape: the trainer calls the architecture's steps
// and names no model type.
//
//   1. init_distributed()    the process group and mesh (none with --parallel none)
//   2. build_model()         the ModelSpec's model on the meta device -> apply_tp -> apply_ac ->
//                            apply_fsdp (blocks, then the root) or apply_replicate -> materialise
//                            this rank's shards -> deterministic init (or --init-from's weights)
//   3. build_optimizer()     --optimizer (optimizer.h) over the local shards
//   4. train_step()          micro-batches (gradient sync on the last), clip, step
//   5. checkpoint_save() / checkpoint_load()   sharded checkpoints, resumable at any world size
//
//   fsdprun --nproc-per-node 2 -- build/bin/train_gpt            # the README's first command
//   build/bin/train_gpt --parallel none                          # one process, no process group
//
// run_training() at the bottom only wires the steps of a run (set-up checks, the blocks above,
// the loop {step, agree, evaluate, report, save}, export, sample, finish); the helpers live in
// files of their own: the architectures (spec.h), rank 0's output and the metrics file
// (report.h), what a step measures (step_stats.h), a clean stop on SIGINT/SIGTERM (stop_signal.h:
// exit at once before the first step, save at the next step or batch after it), the test kill
// hook (kill_hook.h), the memory preflight (preflight.h), the check that every rank got the same
// options (fingerprint.h) and the checkpoint policy (checkpoints.h).
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoints.h"
#include "data.h"
#include "device.h"
#include "error_text.h"
#include "fingerprint.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/debug/cpu_tuning.h"
#include "fsdp/debug/malloc_tuning.h"
#include "fsdp/fsdp.h"
#include "kill_hook.h"
#include "lr_schedule.h"
#include "model.h"
#include "models/llama/hf.h"
#include "optimizer.h"
#include "options.h"
#include "preflight.h"
#include "profile.h"
#include "report.h"
#include "spec.h"
#include "step_stats.h"
#include "stop_signal.h"

namespace {

using namespace train_gpt;
using Shapes = std::map<std::string, std::vector<int64_t>>;

// What the blocks share about the process group.
struct Run {
  Options opt;
  int rank = 0;
  int world = 1;
  std::shared_ptr<fsdp::comm::Comm> comm;   // null with --parallel none
  std::optional<fsdp::DeviceMesh> mesh;     // hsdp: replicate x shard; fsdp/replicate: all ranks;
                                            // --tp-size: the "dp" dim of {"dp", "tp"}
  std::optional<fsdp::DeviceMesh> tp_mesh;  // --tp-size > 1: the "tp" dim (tensor parallel)
  std::optional<fsdp::DeviceMesh> ep_mesh;  // --ep-size > 1: {"dp", "ep"} (expert parallel; the
                                            //   dense rest is FSDP over all ranks, mesh unset)
  int dp_rank = 0;                          // which slice of the global batch this rank trains:
  int dp_size = 1;                          //   the tp ranks of one dp group share it
  torch::Device device = torch::kCPU;       // --device: this rank's GPU, or the CPU
  bool distributed() const { return comm != nullptr; }
  // One process or a world of one: the trainer's own reductions (the loss and stop flag, the memory
  // gather, the validation sum, the sampled token) are skipped, the sum over one rank being its own
  // value, so a world of one costs no more than --parallel none there (no copies to the device and
  // back, checks or flight records of a collective). FSDP's own collectives (inside fully_shard and
  // clip_grad_norm_) still run: a world of one is FSDP.
  bool alone() const { return world == 1; }
  // fully_shard applies: every distributed run but replicate. Under TP over the whole world it
  // shards over the dp dimension of size 1 (as FSDP2 does: the shards are the whole parameters),
  // so the mixed-precision policy, clipping and checkpoints take the path of every other run.
  bool sharded() const { return distributed() && opt.parallel != "replicate"; }
};

// The model trained (spec.h) and what the trainer keeps of its parallelisation.
struct Model {
  std::unique_ptr<TrainModel> net;           // the architecture's model (--model)
  std::vector<fsdp::FSDPModule> units;       // the blocks, then the root (empty: unsharded)
  std::optional<fsdp::ReplicateModule> ddp;  // --parallel replicate
  Shapes full_shapes;                        // "model.<fqn>" -> unsharded shape (checkpoint keys)
  int64_t n_params = 0;

  std::shared_ptr<torch::nn::Module> module() const { return net->module(); }
  std::vector<at::Tensor> parameters() const { return module()->parameters(); }
  // idx [B, T] -> logits [B, T, vocab] (through the root's FSDP hooks).
  at::Tensor logits(const at::Tensor& idx) { return net->logits(idx); }
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const { return net->loss(logits, targets); }
  // The last position's logits [B, vocab], for sampling (gathered, then resharded on return).
  at::Tensor next_token_logits(const at::Tensor& idx) { return net->next_token_logits(idx); }
};

// Sum over ranks, in place (a no-op when alone(): Run). Through the device: NCCL takes CUDA tensors.
void all_reduce_sum(const Run& run, at::Tensor& t) {
  if (run.alone()) return;
  at::Tensor on_device = t.to(run.device);
  run.comm->all_reduce(on_device, fsdp::comm::ReduceOp::Sum);
  t.copy_(on_device);
}

// True on every rank when a stop signal reached any rank (one small all-reduce: every rank must
// call it at the same points). Used between validation batches and sampled tokens.
bool agreed_stop(const Run& run) {
  at::Tensor t = at::full({1}, stop_signal::requested() ? 1.0 : 0.0, at::kDouble);
  all_reduce_sum(run, t);
  return t.item<double>() > 0;
}

// ======================================================================================== 1
// init_distributed(): join the ranks fsdprun (or torchrun) started. The one place that turns
// --parallel into a process group / mesh: HSDP and replicate plug in here.
Run init_distributed(const Options& o) {
  Run run;
  run.opt = o;
  const fsdp::dist::LaunchEnv env = fsdp::dist::read_launch_env();
  run.device = pick_device(o.device, env.local_rank, o.parallel == "none" ? 1 : env.local_world_size, o.share_gpu);
  if (o.parallel == "none") {
    // One process, no process group: a plain module (fsdp::call is forward). Threads: the
    // launcher's OMP_NUM_THREADS when set, else every core.
    if (std::getenv("OMP_NUM_THREADS") == nullptr) fsdp::dist::set_num_threads(fsdp::dist::default_omp_threads(1));
    return run;
  }
  fsdp::dist::InitOptions init;
  init.device_type = run.device.is_cuda() ? "cuda" : "cpu";
  if (run.device.is_cuda() && o.share_gpu) init.backend = fsdp::comm::BackendKind::Gloo;
  fsdp::dist::init_distributed(init);
  run.rank = fsdp::dist::rank();
  run.world = fsdp::dist::world_size();
  run.comm = fsdp::dist::world_comm();
  // Every rank must have the same options (fingerprint.h): checked before the first collective
  // that depends on them (the HSDP mesh's groups).
  check_same_options_on_every_rank(*run.comm, o);
  if (o.parallel == "hsdp") {
    // Shard within groups of --shard-size ranks (default: a node), replicate across them.
    const int64_t shard = o.shard_size > 0 ? o.shard_size : fsdp::dist::local_world_size();
    if (run.world % shard != 0) {
      throw std::invalid_argument("--shard-size " + std::to_string(shard) + " does not divide the world size " +
                                  std::to_string(run.world) + " (HSDP needs replicas of equal size)");
    }
    run.mesh = fsdp::init_device_mesh({run.world / shard, shard}, {"replicate", "shard"});
  }
  run.dp_rank = run.rank;
  run.dp_size = run.world;
  if (o.tp_size > 1) {
    // Tensor parallel inside groups of --tp-size consecutive ranks, FSDP across them.
    const auto mesh = fsdp::init_device_mesh({run.world / o.tp_size, o.tp_size}, {"dp", "tp"});
    run.tp_mesh = mesh["tp"];
    run.dp_rank = static_cast<int>(run.rank / o.tp_size);
    run.dp_size = static_cast<int>(run.world / o.tp_size);
    run.mesh = mesh["dp"];  // size 1 when TP spans the world: fully_shard still applies its policies
  }
  if (o.ep_size > 1) {
    // Expert groups of --ep-size consecutive ranks, each holding every expert once; the ranks
    // holding the same experts form the "dp" dimension. Every rank still trains its own slice of
    // the batch (the ep ranks are data-parallel ranks too, as in torchtitan).
    run.ep_mesh = fsdp::init_device_mesh({run.world / o.ep_size, o.ep_size}, {"dp", "ep"});
  }
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    fsdp::dist::set_num_threads(fsdp::dist::default_omp_threads(fsdp::dist::local_world_size()));
  }
  return run;
}

// ======================================================================================== 2
// build_model(): construct on meta (no memory), parallelise (TP, activation checkpointing,
// fully_shard block by block then the root), allocate only this rank's shards, initialise them
// to the unsharded model's values. `before_allocating` sees the full shapes while nothing is
// allocated yet (checks, a banner).
fsdp::FullyShardOptions shard_options(const Run& run) {
  const Options& o = run.opt;
  fsdp::FullyShardOptions so;
  so.mesh = run.mesh;  // hsdp: 2-D; fsdp: unset (all ranks)
  if (o.mixed_precision == "bf16") {
    so.mp_policy.param_dtype = at::kBFloat16;  // gather and compute in bf16
    so.mp_policy.reduce_dtype = at::kFloat;    // reduce gradients in fp32; fp32 master shards
  }
  if (o.reshard_after_forward != "default") so.reshard_after_forward = o.reshard_after_forward == "true";
  // Shards, gradients and the optimizer's state in host memory, pinned when the device is a GPU
  // (fast copies to and from it); on the CPU the shards already are there: nothing moves, nothing
  // to pin. The shards of the meta-device model are placed on the host by to_empty.
  if (o.cpu_offload) so.offload_policy = fsdp::CPUOffloadPolicy{.pin_memory = run.device.is_cuda()};
  return so;
}

// Tensor parallel first (on meta), then activation checkpointing (the chosen blocks recompute
// their activations in backward; composes with fully_shard and replicate) and fully_shard over
// dp, as PyTorch composes them.
void parallelize(const Run& run, Model& m) {
  if (run.tp_mesh) m.net->apply_tp(*run.tp_mesh);
  if (const int64_t k = run.opt.checkpoint_every_kth_block(); k > 0) m.net->apply_ac(static_cast<int>(k));
  if (run.sharded()) m.units = m.net->apply_fsdp(shard_options(run));
}

Model build_model(const Run& run, std::unique_ptr<TrainModel> net,
                  const std::function<void(const Shapes&)>& before_allocating) {
  Model m;
  m.net = std::move(net);
  if (run.ep_mesh) m.net->apply_ep(*run.ep_mesh);  // this rank's experts only
  m.net->build_meta();
  for (const auto& [name, shape] : m.net->parameter_shapes()) {  // every expert, also other ranks'
    m.full_shapes["model." + name] = shape;
    int64_t numel = 1;
    for (const int64_t d : shape) numel *= d;
    m.n_params += numel;
  }
  before_allocating(m.full_shapes);
  parallelize(run, m);
  fsdp::to_empty(*m.module(), run.device);  // this rank's shards only
  m.net->init_weights();                    // fsdp::init: same values for any world size (--init-from's are read after)
  if (run.distributed() && !run.sharded()) m.ddp = m.net->apply_replicate();  // whole model per rank
  return m;
}

// ======================================================================================== 3
// build_optimizer(): AdamW (or --optimizer, optimizer.h) over model->parameters(), which after
// fully_shard are the local shards.
std::unique_ptr<torch::optim::Optimizer> build_optimizer(const Run& run, Model& m) {
  auto opt = make_optimizer(run.opt, m.parameters());
  if (run.sharded()) fsdp::check_optimizer_params(*opt);
  return opt;
}

// ======================================================================================== 4
// train_step(): one optimizer step on the global batch of `step`. This rank takes its contiguous
// slice, split into --grad-accum micro-batches; gradients are reduce-scattered only after the
// last one (FSDP2's set_requires_gradient_sync), then clipped over all ranks' shards.
struct StepResult {
  double local_loss = 0;  // this rank's mean loss over its slice
  double grad_norm = 0;   // global, before clipping
};

// --ep-size: the global gradient norm, clipped. fsdp::clip_grad_norm_ sums a parameter's part over
// its shard group, and an expert's group (its "dp" ranks) is one of several, each holding other
// experts: the experts' squares are summed over the world here (each row of each expert is on
// one rank), the rest's norm is fsdp::clip_grad_norm_'s (not clipping: max_norm infinite).
double clip_expert_parallel(const Run& run, Model& m, double max_norm) {
  std::set<const void*> expert;
  for (const auto& p : m.net->expert_parameters()) expert.insert(p.unsafeGetTensorImpl());
  std::vector<at::Tensor> dense, expert_grads, grads;
  for (const auto& p : m.parameters()) {
    const bool is_expert = expert.count(p.unsafeGetTensorImpl()) > 0;
    if (!is_expert) dense.push_back(p);
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    if (is_expert && p.grad().numel() > 0) expert_grads.push_back(p.grad());
  }
  const double dense_norm = fsdp::clip_grad_norm_(dense, std::numeric_limits<double>::infinity());
  at::Tensor squares = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(run.device));
  if (!expert_grads.empty()) squares += at::stack(at::_foreach_norm(expert_grads, 2)).to(at::kDouble).pow(2).sum();
  all_reduce_sum(run, squares);
  const double norm = std::sqrt(dense_norm * dense_norm + squares.item<double>());
  const double coef = max_norm / (norm + 1e-6);  // as torch::nn::utils::clip_grad_norm_
  if (coef < 1 && !grads.empty()) {
    torch::NoGradGuard no_grad;
    at::_foreach_mul_(grads, coef);
  }
  return norm;
}

StepResult train_step(const Run& run, Model& m, torch::optim::Optimizer& opt, const TokenSource& data, int64_t step,
                      double lr) {
  const Options& o = run.opt;
  set_lr(opt, lr);
  opt.zero_grad();
  const at::Tensor global = data.train_batch(step, o.batch_size);
  StepResult r;
  // The micro-batches' losses summed on the device (in float64, as the host would) and read once
  // per step: a read per micro-batch would stop the host until each backward is done.
  at::Tensor loss_sum;
  for (int64_t micro = 0; micro < o.grad_accum; ++micro) {
    const bool last = micro == o.grad_accum - 1;
    if (!m.units.empty()) m.units.back().set_requires_gradient_sync(last);
    if (m.ddp) m.ddp->set_requires_gradient_sync(last);
    const at::Tensor batch = local_slice(global, run.dp_rank, run.dp_size, micro, o.grad_accum).to(run.device);
    auto logits = m.logits(batch.narrow(1, 0, o.seq_len));
    auto loss = m.loss(logits, batch.narrow(1, 1, o.seq_len)) / o.grad_accum;
    loss.backward();
    const at::Tensor l = loss.detach().to(at::kDouble);
    loss_sum = loss_sum.defined() ? loss_sum + l : l;
  }
  r.local_loss = loss_sum.item<double>();
  const double max_norm = o.clip > 0 ? o.clip : std::numeric_limits<double>::infinity();
  // Sharded (FSDP, with or without TP): the norm over every rank's shards. Replicated or one
  // process: the gradients are whole (and, replicated, already averaged, so equal on every rank).
  r.grad_norm = run.ep_mesh     ? clip_expert_parallel(run, m, max_norm)
                : run.sharded() ? fsdp::clip_grad_norm_(m.parameters(), max_norm)
                                : torch::nn::utils::clip_grad_norm_(m.parameters(), max_norm);
  const fsdp::profiler::Range optimizer_range("fsdp::optimizer_step");
  opt.step();
  return r;
}

// ======================================================================================== 5
// checkpoint_save() / checkpoint_load(): sharded checkpoints <dir>/step_NNNNNN (one file per
// rank + index.json, committed last). The model, AdamW's state and the trainer's position (the
// step: the data stream is a function of (seed, step)) travel together; load reshards to the
// current world size.
struct TrainerScalars : fsdp::checkpoint::ScalarState {
  TrainerScalars() {
    ints["step"] = 0;
    ints["seed"] = 0;
  }
};

std::string step_dir(const std::string& root, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%06lld", static_cast<long long>(step));
  return (std::filesystem::path(root) / name).string();
}

std::string checkpoint_save(const Run& run, Model& m, torch::optim::Optimizer& opt, int64_t step,
                            const TokenSource& data) {
  const std::string dir = step_dir(run.opt.checkpoint_dir, step);
  TrainerScalars scalars;
  scalars.ints["step"] = step;
  scalars.ints["seed"] = static_cast<int64_t>(run.opt.seed);
  if (data.tokens()) {  // token shards: where the next step reads (epoch, index in its permutation)
    const fsdp::data::Position next = data.position(step);
    scalars.ints["data_epoch"] = next.epoch;
    scalars.ints["data_index"] = next.index;
  }
  // The checkpoint records its model, so that it describes itself (fsdp-ckpt export-hf) and a
  // resume can refuse another model (check_resume_model, model.h): spec.h checkpoint_record.
  const auto [entry, record] = m.net->checkpoint_record(run.opt);
  std::map<std::string, fsdp::checkpoint::Stateful*> extras{{"trainer", &scalars}, {entry, record.get()}};
  fsdp::checkpoint::save(dir, fsdp::checkpoint::State{m.module(), &opt, extras, {}});
  return dir;
}

// The library names an optimizer mismatch in its own terms (LoadOptions, its codecs' names:
// CheckpointError::optimizer_mismatch); the trainer's fix is --optimizer: one line, exit status 2.
// Returns when `e` is about something else.
void throw_if_other_optimizer(const std::string& dir, const Options& o, const fsdp::checkpoint::CheckpointError& e) {
  if (!e.optimizer_mismatch) return;
  std::vector<std::string> names;  // the codecs' names ("Adam", "AdamW", ...) that --optimizer offers
  for (std::string name : e.optimizer_mismatch->saved_by) {
    for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (name == "adamw" || name == "adam" || name == "sgd" || name == "adagrad" || name == "rmsprop")
      names.push_back(name);
  }
  std::string fix = "the --optimizer it was trained with";
  if (!names.empty()) {
    fix = "--optimizer " + names[0];
    for (size_t k = 1; k < names.size(); ++k) fix += (k + 1 == names.size() ? " or " : ", ") + names[k];
    fix += " (what it was trained with)";
  }
  throw std::invalid_argument("checkpoint " + dir + " holds the state of another optimizer than --optimizer " +
                              o.optimizer + ": resume with " + fix + ", or give another --checkpoint-dir");
}

// Returns the number of steps the checkpoint had completed.
int64_t checkpoint_load(const Run& run, Model& m, torch::optim::Optimizer& opt, const std::string& dir,
                        const TokenSource& data) {
  TrainerScalars scalars;
  // --ep-size: this rank's model holds its experts only, and the checkpoint every expert; the
  // other ranks' are not this rank's to load (check_checkpoint_shapes checked every key and shape
  // against the whole model before anything was allocated).
  fsdp::checkpoint::LoadOptions load_options;
  load_options.strict = !run.ep_mesh;
  try {
    fsdp::checkpoint::load(dir, fsdp::checkpoint::State{m.module(), &opt, {{"trainer", &scalars}}, {}}, load_options);
  } catch (const fsdp::checkpoint::CheckpointError& e) {
    throw_if_other_optimizer(dir, run.opt, e);
    throw;
  }
  if (data.tokens() && scalars.ints.count("data_epoch") && run.rank == 0) {
    // The order is a function of (seed, step): another position means other shards or batch shape.
    const fsdp::data::Position here = data.position(scalars.ints["step"]);
    if (here != fsdp::data::Position{scalars.ints["data_epoch"], scalars.ints["data_index"]}) {
      std::printf(
          "note: %s stopped at data epoch %lld, index %lld; with these shards and --batch-size step %lld reads "
          "epoch %lld, index %lld\n",
          dir.c_str(), static_cast<long long>(scalars.ints["data_epoch"]),
          static_cast<long long>(scalars.ints["data_index"]), static_cast<long long>(scalars.ints["step"]),
          static_cast<long long>(here.epoch), static_cast<long long>(here.index));
    }
  }
  if (scalars.ints["seed"] != static_cast<int64_t>(run.opt.seed) && run.rank == 0) {
    std::printf("note: %s was trained with --seed %lld; continuing with --seed %llu changes the data order\n",
                dir.c_str(), static_cast<long long>(scalars.ints["seed"]),
                static_cast<unsigned long long>(run.opt.seed));
  }
  return scalars.ints["step"];
}

// Resuming a checkpoint of another model is an error before any work (one line): the model the
// checkpoint records (model.h), then every shape (all an older checkpoint without the record has).
void check_checkpoint_shapes(const std::string& dir, const Options& o, const TrainModel& net, const Shapes& expected) {
  check_resume_model(dir, o, net);
  const auto saved = fsdp::checkpoint::describe(dir);
  auto shape_str = [](const std::vector<int64_t>& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  };
  for (const auto& [key, shape] : expected) {
    auto it = saved.find(key);
    if (it == saved.end()) {
      throw std::invalid_argument("checkpoint " + dir + " is of another model shape: it has no " + key +
                                  " (resume with the options it was trained with, or another --checkpoint-dir)");
    }
    if (it->second.global_shape != shape) {
      throw std::invalid_argument("checkpoint " + dir + " is of another model shape: " + key + " is " +
                                  shape_str(it->second.global_shape) + " there, " + shape_str(shape) +
                                  " here (resume with the same --layers/--dim/--heads/--seq-len, or another "
                                  "--checkpoint-dir)");
    }
  }
  for (const auto& [key, meta] : saved) {
    if (key.rfind("model.", 0) == 0 && !expected.count(key)) {
      throw std::invalid_argument("checkpoint " + dir + " is of another model shape: it has " + key +
                                  ", this model does not (resume with the same --layers, or another --checkpoint-dir)");
    }
  }
}

// ---------------------------------------------------------------------------------- the rest

// Mean validation loss over --eval-batches global batches (all ranks take part); nullopt when a
// stop signal interrupted it (the ranks agree before each batch).
std::optional<double> evaluate(const Run& run, Model& m, const TokenSource& data) {
  const Options& o = run.opt;
  torch::NoGradGuard no_grad;
  double sum = 0;
  for (int64_t i = 0; i < o.eval_batches; ++i) {
    if (agreed_stop(run)) {
      for (auto& u : m.units) u.reshard();
      return std::nullopt;
    }
    const at::Tensor global = data.val_batch(i, o.batch_size);
    for (int64_t micro = 0; micro < o.grad_accum; ++micro) {
      const at::Tensor batch = local_slice(global, run.dp_rank, run.dp_size, micro, o.grad_accum).to(run.device);
      auto logits = m.logits(batch.narrow(1, 0, o.seq_len));
      sum += m.loss(logits, batch.narrow(1, 1, o.seq_len)).item<double>();
    }
  }
  for (auto& u : m.units) u.reshard();  // no backward follows: free what forward kept
  at::Tensor t = at::full({1}, sum, at::kDouble);
  all_reduce_sum(run, t);
  return t.item<double>() / static_cast<double>(o.eval_batches * o.grad_accum * run.world);
}

// Samples --sample-tokens bytes after a prompt from the validation text (temperature 0.8). Every
// rank runs the forwards (the all-gathers need them all); rank 0's choice is broadcast.
std::string sample_text(const Run& run, Model& m, const TokenSource& data) {
  const Options& o = run.opt;
  torch::NoGradGuard no_grad;
  at::Tensor ctx = data.prompt(std::min<int64_t>(48, o.seq_len));
  auto gen = at::detail::createCPUGenerator(o.seed + 12345);
  const int64_t prompt_len = ctx.size(1);
  std::string stopped;
  for (int64_t i = 0; i < o.sample_tokens; ++i) {
    if (agreed_stop(run)) {  // the ranks agree before each token
      stopped = " [stopped by a signal]";
      break;
    }
    const int64_t len = ctx.size(1);
    at::Tensor window = ctx.narrow(1, std::max<int64_t>(0, len - o.seq_len), std::min(len, o.seq_len));
    // A forward method (fsdp/sharding/forward_method.h): gathered, then resharded on return.
    auto logits = m.next_token_logits(window.to(run.device));
    auto probs = at::softmax(logits.to(at::kCPU, at::kFloat)[0] / 0.8, -1);
    at::Tensor next = at::multinomial(probs, 1, false, gen).to(at::kLong);
    if (!run.alone()) {
      at::Tensor on_device = next.to(run.device);  // NCCL takes CUDA tensors
      run.comm->broadcast(on_device, 0);
      next = on_device.cpu();
    }
    ctx = at::cat({ctx, next.view({1, 1})}, 1);
  }
  for (auto& u : m.units) u.reshard();
  // The prompt, "|" where the model takes over, the generated text (data.h decodes: bytes, or tokens).
  const at::Tensor flat = ctx[0].contiguous();
  const std::vector<int64_t> all(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel());
  return data.decode({all.begin(), all.begin() + prompt_len}) + "|" +
         data.decode({all.begin() + prompt_len, all.end()}) + stopped;
}

// Global loss and the stop flag in one all-reduce: every rank must agree to stop together.
struct Agreed {
  double loss = 0;
  bool stop = false;
};
Agreed agree_loss_and_stop(const Run& run, double local_loss) {
  at::Tensor red = at::tensor({local_loss, stop_signal::requested() ? 1.0 : 0.0}, at::kDouble);
  all_reduce_sum(run, red);
  return {red[0].item<double>() / run.world, red[1].item<double>() > 0};
}

// --cpu-offload: where the shards are, counted (every one on the host, or the policy is not in force).
std::string offload_note(const Run& run, Model& m) {
  size_t on_host = 0;
  const auto params = m.parameters();
  for (const auto& p : params) on_host += p.device().is_cpu() ? 1 : 0;
  const bool fused = run.opt.optimizer.rfind("fused-", 0) == 0;
  return "cpu offload: fully_shard's CPUOffloadPolicy on " + std::to_string(m.units.size()) + " units; " +
         std::to_string(on_host) + " of " + std::to_string(params.size()) +
         " parameter shards, their gradients and the optimizer state in host memory" +
         (run.device.is_cpu() ? " (--device cpu: where they are anyway)" : "") + "; --optimizer " + run.opt.optimizer +
         " steps them" + (fused ? "" : " (--optimizer fused-adamw is the fast pairing)");
}

BannerInfo banner_info(const Run& run, Model& m, const TokenSource& data,
                       const std::optional<std::string>& resume_dir) {
  const Options& o = run.opt;
  BannerInfo info;
  info.world = run.world;
  info.threads = at::get_num_threads();
  info.n_params = m.n_params;
  info.local_params = tensor_bytes(m.parameters()) / 4;
  info.data = data.describe();
  info.resumed_dir = resume_dir;
  info.model = m.net->describe(o);
  if (o.cpu_offload) info.offload = offload_note(run, m);
  if (!o.init_from.empty() && resume_dir)
    info.resume_note = "the checkpoint wins: " + o.init_from +
                       "'s weights are not loaded; its config.json matches the checkpoint's model";
  return info;
}

// Every rank waits for the others, then leaves the process group (nothing with --parallel none).
void finish_distributed(const Run& run) {
  if (!run.distributed()) return;
  run.comm->barrier();
  fsdp::dist::destroy_distributed();
}

// --eval-only: the validation loss of the model as built or loaded, printed and written to the
// metrics file; no training, no checkpoint.
int evaluate_only(const Run& run, Model& m, const TokenSource& data, int64_t step,
                  const std::optional<std::string>& resume_dir) {
  const Options& o = run.opt;
  Reporter report(o, run.rank == 0, step);
  report.banner(banner_info(run, m, data, resume_dir));
  const std::optional<double> val = evaluate(run, m, data);
  report.evaluation(step, val);
  finish_distributed(run);
  return 0;
}

// ---------------------------------------------------------------------------- the steps of a run

// Every rank, before the process group and any allocation: a directory it cannot write stops it
// here (--eval-only writes none), --export-hf's destination (checkpoints.h), the memory preflight
// (preflight.h: every rank computes the same estimate; returned for rank 0 to print before the
// model is allocated) and --tp-size against the world size.
std::string check_before_work(const Options& options, const TrainModel& net) {
  if (!options.eval_only) check_checkpoint_dir(options);
  check_export_dir(options);
  const fsdp::dist::LaunchEnv env =
      options.parallel == "none" ? fsdp::dist::LaunchEnv{} : fsdp::dist::read_launch_env();
  const std::string memory = check_memory(options, net.parameter_count(options), env.world_size, env.local_world_size);
  if (options.parallel != "none") validate_for_world(options, env.world_size);  // --tp-size | world, before joining
  return memory;
}

// The checkpoint to continue from (--resume-from, or --resume's latest committed one); rank 0
// prints the folders skipped on the way.
std::optional<std::string> resume_checkpoint(const Run& run) {
  const ResumeChoice resume = choose_resume(run.opt);
  if (run.rank == 0) {
    for (const auto& w : resume.warnings) std::printf("train_gpt: warning: %s\n", w.c_str());
  }
  return resume.dir;
}

// The model of --model built, parallelised and initialised (block 2); the resume checkpoint is
// checked against its shapes before anything is allocated. --init-from: each rank reads its own
// rows of the weights, unless a checkpoint to resume is there (it wins: it holds the weights
// trained since).
Model build_and_load(const Run& run, std::unique_ptr<TrainModel> net, const std::optional<std::string>& resume_dir,
                     const std::string& memory) {
  const Options& o = run.opt;
  const TrainModel& arch = *net;
  Model m = build_model(run, std::move(net), [&](const Shapes& shapes) {
    if (resume_dir) check_checkpoint_shapes(*resume_dir, o, arch, shapes);
    if (run.rank == 0) {
      std::printf("train_gpt: %s\n", memory.c_str());  // then the (possibly long) allocation and init
      std::fflush(stdout);
    }
  });
  if (!o.init_from.empty() && !resume_dir) m.net->load_weights(o);
  return m;
}

// A resumed checkpoint at or past --steps: nothing to do; says so and leaves the metrics file alone.
bool nothing_to_train(const Run& run, const std::optional<std::string>& resume_dir, int64_t start_step) {
  if (!resume_dir || start_step < run.opt.steps) return false;
  if (run.rank == 0) {
    std::printf(
        "train_gpt: checkpoint %s is at step %lld, --steps %lld: nothing to train (raise --steps to continue it)\n",
        resume_dir->c_str(), static_cast<long long>(start_step), static_cast<long long>(run.opt.steps));
    std::fflush(stdout);
  }
  return true;
}

// Rank 0's banner, and a note on an option that does nothing in this run.
void announce(const Run& run, Model& m, const TokenSource& data, const std::optional<std::string>& resume_dir,
              Reporter& report) {
  const Options& o = run.opt;
  report.banner(banner_info(run, m, data, resume_dir));
  if (run.rank == 0 && run.sharded() && run.dp_size == 1 && o.reshard_after_forward != "default") {
    std::printf(
        "train_gpt: note: --reshard-after-forward %s has no effect with a data-parallel size of 1 (each "
        "rank's shards are the whole parameters: nothing is gathered or freed)\n",
        o.reshard_after_forward.c_str());
    std::fflush(stdout);
  }
}

// Where the loop is: the steps done, the last checkpoint written, whether a signal stopped it.
struct LoopState {
  int64_t step = 0;
  std::string last_saved;
  bool stopped = false;
};

// The validation loss when one is due after `step` (nullopt: none due, or interrupted: `stop` set).
std::optional<double> evaluate_if_due(const Run& run, Model& m, const TokenSource& data, int64_t step, bool& stop) {
  const Options& o = run.opt;
  if (stop || o.eval_every <= 0 || (step % o.eval_every != 0 && step != o.steps)) return std::nullopt;
  std::optional<double> val = evaluate(run, m, data);
  if (!val) stop = true;  // interrupted: save this step's state and exit
  return val;
}

// Block 5 (save): every --checkpoint-every steps, at the end, and when asked to stop.
void save_if_due(const Run& run, Model& m, torch::optim::Optimizer& opt, const TokenSource& data, Reporter& report,
                 LoopState& s, bool stop) {
  const Options& o = run.opt;
  const bool due = (o.checkpoint_every > 0 && s.step % o.checkpoint_every == 0) || s.step == o.steps || stop;
  if (o.checkpoint_dir.empty() || !due) return;
  const StepTimer save_timer;
  s.last_saved = checkpoint_save(run, m, opt, s.step, data);
  if (run.rank == 0)
    report.checkpoint_saved(s.step, s.last_saved, save_timer.finish().seconds, apply_retention(o, s.last_saved));
}

// One pass of the loop: step (block 4), agree on the loss and on stopping, evaluate, report,
// save. Returns false when the ranks agreed to stop.
bool loop_once(const Run& run, Model& m, torch::optim::Optimizer& opt, const TokenSource& data, Reporter& report,
               LoopState& s) {
  const Options& o = run.opt;
  const double lr = lr_at(s.step, o.steps, o.lr, o.warmup);
  const StepTimer timer;
  const StepResult r = train_step(run, m, opt, data, s.step, lr);
  stop_signal::set_phase(stop_signal::kTraining);  // from now on a signal saves a checkpoint
  const StepCost cost = timer.finish();
  const int64_t step = ++s.step;

  auto [loss, stop] = agree_loss_and_stop(run, r.local_loss);
  at::Tensor router = m.net->step_stats();   // --model moe: [aux, tokens per expert] (spec.h)
  std::optional<uint64_t> all_to_all_bytes;  // --ep-size: summed over the ranks, with the router's figures
  if (run.ep_mesh) {
    at::Tensor sent = at::full({1}, static_cast<double>(cost.all_to_all_bytes), at::kDouble);
    router = router.defined() ? at::cat({router, sent}) : sent;
  }
  if (router.defined()) all_reduce_sum(run, router);
  if (run.ep_mesh) {
    all_to_all_bytes = static_cast<uint64_t>(std::llround(router[-1].item<double>()));
    router = router.size(0) > 1 ? router.narrow(0, 0, router.size(0) - 1) : at::Tensor();
  }
  const RankMemory memory_now = gather_memory(run.alone() ? nullptr : run.comm.get(), run.device);
  const std::optional<double> val = evaluate_if_due(run, m, data, step, stop);
  if (run.rank == 0) {
    StepReport line{step,
                    loss,
                    lr,
                    r.grad_norm,
                    cost.seconds,
                    cost.comm_bytes,
                    tensor_bytes(m.parameters()),
                    grad_bytes(m.parameters()),
                    optimizer_state_bytes(opt),
                    memory_now.current_bytes,
                    memory_now.peak_bytes.at(0),
                    memory_now.max_peak_bytes(),
                    val,
                    data.tokens() ? std::optional(data.position(step)) : std::nullopt,
                    std::nullopt,
                    std::nullopt,
                    all_to_all_bytes};
    if (router.defined()) {
      const at::Tensor load = router.narrow(0, 1, router.size(0) - 1);
      line.aux_loss = router[0].item<double>() / run.world;
      line.expert_load = std::pair{load.min().item<int64_t>(), load.max().item<int64_t>()};
    }
    report.step(line);
  }
  save_if_due(run, m, opt, data, report, s, stop);
  s.stopped = stop;
  return !stop;
}

// The loop from `start_step` to --steps (or a stop signal), under --profile-steps and the tests' kill hook.
LoopState train_loop(const Run& run, Model& m, torch::optim::Optimizer& opt, const TokenSource& data, Reporter& report,
                     int64_t start_step) {
  const KillHook kill_hook = KillHook::from_env();  // tests only (kill_hook.h)
  StepProfiler profiler(run.opt.profile_steps, profile_dir(run.opt.profile_dir, run.opt.metrics), run.rank,
                        run.rank == 0);
  LoopState s;
  s.step = start_step;
  while (s.step < run.opt.steps) {
    const auto profiled = profiler.step(s.step + 1);  // steps A..B of --profile-steps into DIR/trace_rank<r>.json
    kill_hook.before_step(s.step, run.rank);
    if (!loop_once(run, m, opt, data, report, s)) break;
  }
  return s;
}

// --export-hf: the trained model as a Hugging Face folder (collective: the ranks gather one
// tensor at a time, rank 0 writes). Not after a signal: the checkpoint holds that state
// (fsdp-ckpt export-hf CHECKPOINT OUT writes the same folder from it).
void export_model(const Run& run, Model& m) {
  const Options& o = run.opt;
  if (o.export_hf.empty()) return;
  const StepTimer export_timer;
  m.net->export_hf(o);
  if (run.rank == 0) {
    std::printf("train_gpt: exported the model (%s) to %s for transformers (%.2f s)\n", o.export_dtype.c_str(),
                o.export_hf.c_str(), export_timer.finish().seconds);
    std::fflush(stdout);
  }
}

// main()'s body: the steps of a run, in order (llm.c's main loop: only the wiring).
int run_training(const Options& options, std::unique_ptr<TrainModel> net) {
  const std::string memory = check_before_work(options, *net);
  const Run run = init_distributed(options);  // 1
  const Options& o = run.opt;
  validate_for_world(o, run.world);
  // One run per --checkpoint-dir: rank 0 holds the lock until the process ends (checkpoints.h).
  const auto checkpoint_lock =
      o.eval_only ? fsdp::checkpoint::DirectoryLock{} : lock_checkpoint_dir(o, run.rank, run.comm.get());
  const TokenSource data(o);  // token shards: those resolve_vocab() opened and checked in main()
  const std::optional<std::string> resume_dir = resume_checkpoint(run);
  Model m = build_and_load(run, std::move(net), resume_dir, memory);                             // 2
  auto opt = build_optimizer(run, m);                                                            // 3
  const int64_t start_step = resume_dir ? checkpoint_load(run, m, *opt, *resume_dir, data) : 0;  // 5 (load)
  if (o.eval_only) return evaluate_only(run, m, data, start_step, resume_dir);
  if (nothing_to_train(run, resume_dir, start_step)) {
    finish_distributed(run);
    return 0;
  }
  check_save_targets(o, start_step);  // a scheduled save into a damaged folder: refused now, not after training
  Reporter report(o, run.rank == 0, start_step);  // rank 0's banner, progress lines, metrics file (report.h)
  announce(run, m, data, resume_dir, report);
  const LoopState end = train_loop(run, m, *opt, data, report, start_step);  // 4 and 5 (save)
  if (!end.stopped) export_model(run, m);
  const std::string sample = !end.stopped && o.sample_tokens > 0 ? sample_text(run, m, data) : "";
  report.finish(end.step, run.world, end.stopped, end.last_saved, sample);
  finish_distributed(run);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  stop_signal::install();  // until the first step has finished, a signal exits at once
  int exit_code = 0;
  auto options = parse_options(argc, argv, exit_code);
  if (!options) return exit_code;
  // --malloc warm (the default): glibc's thresholds raised as a long-running process has them; tuned:
  // tensors of 1 MiB+ go back to the kernel when freed (FSDP_MALLOC_TUNING=0 still vetoes both).
  if (options->malloc_policy == "tuned") fsdp::tune_malloc();
  if (options->malloc_policy == "warm") fsdp::raise_malloc_thresholds();
  try {
    validate(*options);
    // spec.h's registry: --model's architecture, or --init-from's (its config.json's architectures).
    const ModelSpec& spec = options->init_from.empty() ? model_spec(options->model) : spec_for_init_from(*options);
    options->model = spec.name;
    if (options->ep_size > 1 && !spec.experts)
      throw std::invalid_argument("--ep-size " + std::to_string(options->ep_size) + ": --model " + spec.name +
                                  " has no experts (expert parallelism is for --model moe or --init-from a "
                                  "mixture-of-experts folder)");
    std::unique_ptr<TrainModel> model = spec.make();
    model->validate(*options);
    // --init-from: the sizes and the vocabulary from its config, before the data is checked against it.
    if (!options->init_from.empty()) model->read_init_from(*options);
    options->vocab_size = resolve_vocab(*options);  // token shards checked here, before any work (data.h)
    model->configure(*options);                     // from scratch: sized by the options
    return run_training(*options, std::move(model));
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "train_gpt: error: %s\n", error_text(e).c_str());
    return 2;
  } catch (const fsdp::models::HFError& e) {  // a bad model folder or export destination: bad input too
    std::fprintf(stderr, "train_gpt: error: %s\n", error_text(e).c_str());
    return 2;
  } catch (const std::exception& e) {
    // The whole message (hints on later lines too), without LibTorch's backtrace (error_text.h).
    std::fprintf(stderr, "train_gpt: error: %s\n", error_text(e).c_str());
    return 1;
  }
}
