#pragma once
// How an optimizer's state travels in checkpoints and state dicts: a registry of codecs, one per
// optimizer class, naming its per-parameter state fields and its param-group hyperparameters.
//
// Built in: torch::optim::Adam, AdamW, SGD, Adagrad, RMSprop, and fsdp::optim::FusedAdam,
// FusedAdamW, FusedSGD (fsdp/optim/fused.h: their base's keys, so each loads the other's state).
// LBFGS is refused (see below). Any other class is refused with an error naming it and pointing
// here; register yours:
//
// Example:
//   struct MyState : torch::optim::OptimizerCloneableParamState<MyState> {
//     TORCH_ARG(at::Tensor, velocity);
//     TORCH_ARG(int64_t, step) = 0;
//   };
//   struct MyOptions : torch::optim::OptimizerCloneableOptions<MyOptions> {
//     TORCH_ARG(double, lr) = 0.1;
//     TORCH_ARG(double, beta) = 0.9;
//   };
//   struct MyOpt : torch::optim::Optimizer {
//     using torch::optim::Optimizer::Optimizer;
//     at::Tensor step(LossClosure closure) override { return {}; }  // the update itself
//   };
//   fsdp::checkpoint::register_optimizer(
//       fsdp::checkpoint::OptimizerCodecBuilder<MyOpt, MyState, MyOptions>("MyOpt")
//           .state("velocity", [](MyState& s) -> at::Tensor& { return s.velocity(); })  // shaped like the param
//           .state("step", [](MyState& s) -> int64_t& { return s.step(); })            // a scalar
//           .hyperparameter("lr", [](MyOptions& o) -> double& { return o.lr(); })
//           .hyperparameter("beta", [](MyOptions& o) -> double& { return o.beta(); })
//           .build());
//
// Keys (checkpoint: with "optim." in front; get_optimizer_state_dict: without it):
//   <parameter fqn>.<field>          per-parameter state, by name (never by position); a tensor
//                                    field is shaped like its parameter and sharded like it, so it
//                                    reshards on load; scalar fields (step) are 0-d, from rank 0.
//   param_groups.<g>.<hyperparameter>  group g's hyperparameter as a 1-d float64 tensor (betas:
//                                    2 values, flags: 0/1), from rank 0. Restored on load, so an lr
//                                    changed before saving is the lr after loading.
// A checkpoint's groups must match the optimizer's (same count, same order: build the optimizer
// the same way); checkpoints written before hyperparameters were saved load without them.
//
// Tensor fields must be elementwise, shaped like the parameter (Adam-like optimizers). State of
// another shape (factored second moments, LBFGS's flat history) cannot be sharded by parameter
// rows: keep such an optimizer out of State::optimizer and save its state yourself.
#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <vector>

namespace fsdp::checkpoint {

struct OptimizerCodec {
  std::string name;                                                                // in error messages ("SGD")
  std::type_index type = typeid(void);                                             // the optimizer's exact dynamic type
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>()> make_state;  // a fresh one

  struct Field {
    std::string name;
    bool like_param = true;                  // true: a tensor shaped like the parameter; false: a scalar
    at::ScalarType scalar_type = at::kLong;  // scalars: kLong (int64_t) or kDouble
    // Tensor fields: the state's tensor itself (undefined: absent, not saved). Scalars: a 0-d copy.
    std::function<at::Tensor(torch::optim::OptimizerParamState&)> get;
    std::function<void(torch::optim::OptimizerParamState&, const at::Tensor&)> set;
  };
  std::vector<Field> fields;

  struct Hyperparameter {
    std::string name;
    int64_t size = 1;  // values in its 1-d float64 tensor
    std::function<at::Tensor(torch::optim::OptimizerOptions&)> get;
    std::function<void(torch::optim::OptimizerOptions&, const at::Tensor&)> set;
  };
  std::vector<Hyperparameter> hyperparameters;
};

// Adds (or, for a type already registered, replaces) a codec. Thread-safe; call it before the
// first save or load that uses the optimizer (e.g. at the start of main).
void register_optimizer(OptimizerCodec codec);

// The codec for `optimizer`'s exact type, or nullptr.
const OptimizerCodec* find_optimizer_codec(const torch::optim::Optimizer& optimizer);

// The codec for `optimizer`, or a CheckpointError naming its type and the way out (LBFGS: why).
const OptimizerCodec& optimizer_codec(const torch::optim::Optimizer& optimizer);

// Typed construction of a codec from accessors returning references (what TORCH_ARG's non-const
// getters return), see the example at the top.
template <typename Opt, typename State, typename Options>
class OptimizerCodecBuilder {
 public:
  explicit OptimizerCodecBuilder(std::string name) {
    codec_.name = std::move(name);
    codec_.type = typeid(Opt);
    codec_.make_state = [] { return std::make_unique<State>(); };
  }

  // Accessor: State& -> at::Tensor& (shaped like the parameter), int64_t& or double& (a scalar).
  template <typename Accessor>
  OptimizerCodecBuilder& state(std::string name, Accessor accessor) {
    using T = std::remove_reference_t<decltype(accessor(std::declval<State&>()))>;
    OptimizerCodec::Field f;
    f.name = std::move(name);
    if constexpr (std::is_same_v<T, at::Tensor>) {
      f.like_param = true;
      f.get = [accessor](torch::optim::OptimizerParamState& s) { return accessor(static_cast<State&>(s)); };
      f.set = [accessor](torch::optim::OptimizerParamState& s, const at::Tensor& t) {
        accessor(static_cast<State&>(s)) = t;
      };
    } else {
      static_assert(std::is_same_v<T, int64_t> || std::is_same_v<T, double>,
                    "an optimizer state field is an at::Tensor, an int64_t or a double");
      f.like_param = false;
      f.scalar_type = std::is_same_v<T, int64_t> ? at::kLong : at::kDouble;
      f.get = [accessor, type = f.scalar_type](torch::optim::OptimizerParamState& s) {
        return at::scalar_tensor(accessor(static_cast<State&>(s)), at::TensorOptions().dtype(type));
      };
      f.set = [accessor](torch::optim::OptimizerParamState& s, const at::Tensor& t) {
        accessor(static_cast<State&>(s)) = t.item<T>();
      };
    }
    codec_.fields.push_back(std::move(f));
    return *this;
  }

  // Accessor: Options& -> double&, bool&, int64_t& or std::tuple<double, double>& (betas).
  template <typename Accessor>
  OptimizerCodecBuilder& hyperparameter(std::string name, Accessor accessor) {
    using T = std::remove_reference_t<decltype(accessor(std::declval<Options&>()))>;
    OptimizerCodec::Hyperparameter h;
    h.name = std::move(name);
    if constexpr (std::is_same_v<T, std::tuple<double, double>>) {
      h.size = 2;
      h.get = [accessor](torch::optim::OptimizerOptions& o) {
        auto& v = accessor(static_cast<Options&>(o));
        return at::tensor({std::get<0>(v), std::get<1>(v)}, at::kDouble);
      };
      h.set = [accessor](torch::optim::OptimizerOptions& o, const at::Tensor& t) {
        accessor(static_cast<Options&>(o)) = std::make_tuple(t[0].item<double>(), t[1].item<double>());
      };
    } else {
      static_assert(std::is_same_v<T, double> || std::is_same_v<T, bool> || std::is_same_v<T, int64_t>,
                    "a hyperparameter is a double, bool, int64_t or std::tuple<double, double>");
      h.size = 1;
      h.get = [accessor](torch::optim::OptimizerOptions& o) {
        return at::tensor({static_cast<double>(accessor(static_cast<Options&>(o)))}, at::kDouble);
      };
      h.set = [accessor](torch::optim::OptimizerOptions& o, const at::Tensor& t) {
        const double v = t[0].item<double>();
        if constexpr (std::is_same_v<T, bool>)
          accessor(static_cast<Options&>(o)) = v != 0;
        else
          accessor(static_cast<Options&>(o)) = static_cast<T>(v);
      };
    }
    codec_.hyperparameters.push_back(std::move(h));
    return *this;
  }

  OptimizerCodec build() const { return codec_; }

 private:
  OptimizerCodec codec_;
};

}  // namespace fsdp::checkpoint
