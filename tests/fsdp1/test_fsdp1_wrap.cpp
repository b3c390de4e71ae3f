// FSDP1's API in one process (a world of one): the auto-wrap policies pick exactly the units
// PyTorch's _recursive_wrap would (compared against hand-written fully_shard sequences and hand-
// counted trees), names stay the original module's, meta-device models are initialised through
// param_init_fn, and every option this library cannot honour is refused in one line.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "test_helpers.h"

using fsdp::models::BlockImpl;
using fsdp::models::CausalSelfAttentionImpl;
using fsdp::models::GPT;
using fsdp::models::MLPImpl;

namespace {

fsdp::models::GPTConfig small() {
  fsdp::models::GPTConfig c;
  c.vocab_size = 17;
  c.block_size = 6;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

// unit name -> the parameters it manages
using Units = std::map<std::string, std::vector<std::string>>;

Units units_of(torch::nn::Module& root) {
  Units out;
  for (const auto& [name, unit] : fsdp::named_fsdp_modules(root)) out[name] = fsdp::unit_parameter_names(unit);
  return out;
}

std::vector<std::string> names(const Units& units) {
  std::vector<std::string> out;
  for (const auto& [name, params] : units) out.push_back(name);
  return out;
}

fsdp::FSDPOptions with_policy(fsdp::AutoWrapPolicy policy) {
  fsdp::FSDPOptions o;
  o.auto_wrap_policy = std::move(policy);
  return o;
}

// A tree with hand-counted sizes: Linear(10, 10) holds 110 parameters, Linear(20, 20) 420,
// Linear(5, 5) 30.
struct PairImpl : torch::nn::Module {
  PairImpl() {
    x = register_module("x", torch::nn::Linear(20, 20));
    y = register_module("y", torch::nn::Linear(5, 5));
  }
  torch::nn::Linear x{nullptr}, y{nullptr};
};
TORCH_MODULE(Pair);

struct TreeImpl : torch::nn::Module {
  TreeImpl() {
    a = register_module("a", torch::nn::Linear(10, 10));
    list = register_module("list", torch::nn::ModuleList(torch::nn::Linear(10, 10), torch::nn::Linear(10, 10)));
    seq = register_module(
        "seq", torch::nn::Sequential(torch::nn::Linear(10, 10), torch::nn::Linear(10, 10), torch::nn::Linear(10, 10)));
    pair = register_module("pair", Pair());
  }
  torch::nn::Linear a{nullptr};
  torch::nn::ModuleList list{nullptr};
  torch::nn::Sequential seq{nullptr};
  Pair pair{nullptr};
};
TORCH_MODULE(Tree);

// What apply_auto_wrap_policy selects, in the order it wraps (children first).
std::vector<std::string> selected(torch::nn::Module& root, const fsdp::AutoWrapPolicy& policy) {
  std::map<const torch::nn::Module*, std::string> name_of;
  for (const auto& item : root.named_modules()) name_of[item.value().get()] = item.key();
  std::vector<std::string> out;
  fsdp::apply_auto_wrap_policy(
      root, policy, [&](const std::shared_ptr<torch::nn::Module>& m) { out.push_back(name_of.at(m.get())); });
  return out;
}

}  // namespace

// transformer_auto_wrap_policy({Block}) = fully_shard(each block), fully_shard(model).
TEST(Fsdp1Wrap, TransformerPolicyEqualsHandWrittenBlocks) {
  GPT by_hand(small());
  for (auto& b : by_hand->blocks) fsdp::fully_shard(b);
  fsdp::fully_shard(by_hand);

  GPT model(small());
  fsdp::FSDP wrapped(model, with_policy(fsdp::transformer_auto_wrap_policy<BlockImpl>()));
  const Units want = units_of(*by_hand), got = units_of(*model);
  EXPECT_EQ(names(got), (std::vector<std::string>{"", "h.0", "h.1"}));
  EXPECT_EQ(got, want);
  // The root unit holds what no block took (embeddings, ln_f, head), nothing twice.
  EXPECT_EQ(got.at("h.0").size(), 12u);
  EXPECT_EQ(got.at("").size(), 5u);
  // Original names, no wrapper prefixes.
  std::vector<std::string> plain, fsdp_names;
  for (const auto& p : GPT(small())->named_parameters()) plain.push_back(p.key());
  for (const auto& p : wrapped.named_parameters()) fsdp_names.push_back(p.key());
  EXPECT_EQ(fsdp_names, plain);
  // ModuleWrapPolicy is the same policy.
  GPT again(small());
  fsdp::FSDP w2(again, with_policy(fsdp::ModuleWrapPolicy({fsdp::module_type<BlockImpl>()})));
  EXPECT_EQ(units_of(*again), want);
}

// lambda_auto_wrap_policy(is MLP) = fully_shard(each block's mlp), fully_shard(model).
TEST(Fsdp1Wrap, LambdaPolicyEqualsHandWrittenMlps) {
  GPT by_hand(small());
  for (auto& b : by_hand->blocks) fsdp::fully_shard(b->mlp);
  fsdp::fully_shard(by_hand);

  GPT model(small());
  fsdp::FSDP wrapped(model, with_policy(fsdp::lambda_auto_wrap_policy(
                                [](torch::nn::Module& m) { return dynamic_cast<MLPImpl*>(&m) != nullptr; })));
  EXPECT_EQ(names(units_of(*model)), (std::vector<std::string>{"", "h.0.mlp", "h.1.mlp"}));
  EXPECT_EQ(units_of(*model), units_of(*by_hand));
  // Two types, inner units first: attention and MLP of every block.
  GPT two(small());
  fsdp::FSDP w2(two, with_policy(fsdp::ModuleWrapPolicy(
                         {fsdp::module_type<CausalSelfAttentionImpl>(), fsdp::module_type<MLPImpl>()})));
  EXPECT_EQ(names(units_of(*two)), (std::vector<std::string>{"", "h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp"}));
}

// The size policy counts only parameters no unit below took, never wraps a bare ModuleList and
// only descends into modules that are large enough (PyTorch's size_based_auto_wrap_policy).
TEST(Fsdp1Wrap, SizePolicyCountsOnlyUnwrappedParameters) {
  Tree tree;
  // 150: no single Linear(10, 10) (110) qualifies; the list (220) is a ModuleList, so not wrapped;
  // the Sequential's 330 are all its own; pair.x (420) is wrapped, leaving pair 30 < 150.
  EXPECT_EQ(selected(*tree, fsdp::size_based_auto_wrap_policy(150)), (std::vector<std::string>{"seq", "pair.x"}));
  // 450: pair.x alone (420) is too small, so pair keeps all its 450 and becomes the unit.
  EXPECT_EQ(selected(*tree, fsdp::size_based_auto_wrap_policy(450)), (std::vector<std::string>{"pair"}));
  // 100: every Linear is a unit; what is left above them is empty (0 < 100).
  EXPECT_EQ(selected(*tree, fsdp::size_based_auto_wrap_policy(100)),
            (std::vector<std::string>{"a", "list.0", "list.1", "seq.0", "seq.1", "seq.2", "pair.x"}));
  // Without the default exclusions a ModuleList may be a unit.
  EXPECT_EQ(selected(*tree, fsdp::size_based_auto_wrap_policy(200, {}, std::vector<fsdp::ModuleType>{})),
            (std::vector<std::string>{"list", "seq", "pair.x"}));
  // A forced leaf is neither descended into nor wrapped (its parameters count toward its parent),
  // although its Linears would qualify.
  EXPECT_EQ(selected(*tree, fsdp::size_based_auto_wrap_policy(100, {fsdp::module_type<torch::nn::SequentialImpl>()})),
            (std::vector<std::string>{"a", "list.0", "list.1", "pair.x"}));
  // Through the wrapper: the same units plus the root, each holding its own parameters.
  Tree t2;
  fsdp::FSDP wrapped(t2.ptr(), with_policy(fsdp::size_based_auto_wrap_policy(150)));
  const Units got = units_of(*t2);
  EXPECT_EQ(names(got), (std::vector<std::string>{"", "pair.x", "seq"}));
  EXPECT_EQ(got.at("").size(), 8u);  // a, list.0, list.1, pair.y: weight and bias each
  // ... which is the hand-written sequence _recursive_wrap stands for.
  Tree by_hand;
  fsdp::fully_shard(by_hand->seq), fsdp::fully_shard(by_hand->pair->x), fsdp::fully_shard(by_hand);
  EXPECT_EQ(got, units_of(*by_hand));
}

// The size policy on GPT, against what _recursive_wrap computes by hand. A threshold of one
// block's size makes each block a unit, as the transformer policy does; one more and no block
// qualifies, and the blocks' ModuleList "h", which holds enough, is never a unit (unless the
// exclusion is dropped). A threshold of the MLP's size wraps each MLP; what is left of its block
// (attention and norms) is then below the threshold, so the block is not a unit although all its
// parameters together would be.
TEST(Fsdp1Wrap, SizePolicyOnGptCountsWhatIsLeftAndSkipsTheBlockList) {
  auto numel = [](torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    return n;
  };
  GPT probe(small());
  const int64_t block = numel(*probe->blocks[0]), mlp = numel(*probe->blocks[0]->mlp);
  const int64_t attn = numel(*probe->blocks[0]->attn);
  // What the cases below rely on (small(): block 872, MLP 552, attention 288).
  ASSERT_LT(attn, mlp);
  ASSERT_LT(block - mlp, mlp);
  ASSERT_GE(2 * (block - mlp), mlp);
  for (const auto& p : probe->named_parameters()) {
    if (p.key().rfind("h.", 0) != 0) ASSERT_LT(p.value().numel(), mlp) << p.key();
  }

  GPT model(small());
  fsdp::FSDP wrapped(model, with_policy(fsdp::size_based_auto_wrap_policy(block)));
  GPT by_hand(small());
  for (auto& b : by_hand->blocks) fsdp::fully_shard(b);
  fsdp::fully_shard(by_hand);
  EXPECT_EQ(names(units_of(*model)), (std::vector<std::string>{"", "h.0", "h.1"}));
  EXPECT_EQ(units_of(*model), units_of(*by_hand));

  GPT g1(small()), g2(small()), g3(small()), g4(small());
  EXPECT_TRUE(selected(*g1, fsdp::size_based_auto_wrap_policy(block + 1)).empty());
  EXPECT_EQ(selected(*g2, fsdp::size_based_auto_wrap_policy(block + 1, {}, std::vector<fsdp::ModuleType>{})),
            (std::vector<std::string>{"h"}));
  // h.i keeps block - mlp < mlp after its MLP is taken; h keeps 2 (block - mlp) >= mlp but is a
  // ModuleList.
  EXPECT_EQ(selected(*g3, fsdp::size_based_auto_wrap_policy(mlp)), (std::vector<std::string>{"h.0.mlp", "h.1.mlp"}));
  EXPECT_EQ(selected(*g4, fsdp::size_based_auto_wrap_policy(mlp, {}, std::vector<fsdp::ModuleType>{})),
            (std::vector<std::string>{"h.0.mlp", "h.1.mlp", "h"}));
}

TEST(Fsdp1Wrap, IgnoredModulesStayWhole) {
  GPT model(small());
  fsdp::FSDPOptions o = with_policy(fsdp::transformer_auto_wrap_policy<BlockImpl>());
  o.ignored_modules = {model->lm_head.ptr()};
  fsdp::FSDP wrapped(model, o);
  EXPECT_FALSE(fsdp::shard_info(model->lm_head->named_parameters()["weight"]).has_value());
  EXPECT_TRUE(fsdp::shard_info(model->ln_f->named_parameters()["weight"]).has_value());
  for (const auto& [name, params] : units_of(*model)) {
    for (const auto& p : params) EXPECT_NE(p.rfind("lm_head", 0), 0u) << name;
  }
}

// A meta-device model: sharded without memory, then allocated and initialised by param_init_fn;
// forward equals the model built directly on the CPU.
TEST(Fsdp1Wrap, ParamInitFnInitialisesMetaModel) {
  auto meta_config = small();
  meta_config.device = torch::kMeta;
  GPT model(meta_config);
  fsdp::FSDPOptions o = with_policy(fsdp::transformer_auto_wrap_policy<BlockImpl>());
  o.param_init_fn = [](torch::nn::Module& m) { dynamic_cast<fsdp::models::GPTImpl&>(m).reset_parameters(); };
  fsdp::FSDP wrapped(model, o);
  GPT plain(small());
  auto tokens = at::randint(17, {2, 6}, at::kLong);
  EXPECT_TRUE(at::allclose(wrapped(tokens), plain(tokens), 1e-6, 1e-7));
  // Without param_init_fn the meta tensors are refused.
  GPT meta(meta_config);
  EXPECT_ERROR_CONTAINS(fsdp::FSDP w(meta, fsdp::FSDPOptions{}), "no param_init_fn");
}

TEST(Fsdp1Wrap, RefusesWhatItCannotHonour) {
  auto refused = [](fsdp::FSDPOptions o, const std::string& needle) {
    GPT model(small());
    EXPECT_ERROR_CONTAINS(fsdp::FSDP w(model, o), needle);
  };
  refused({.mixed_precision = fsdp::MixedPrecision{.buffer_dtype = at::kHalf}}, "buffer_dtype is not supported");
  refused({.mixed_precision = fsdp::MixedPrecision{.keep_low_precision_grads = true}},
          "keep_low_precision_grads is not supported");
  refused({.backward_prefetch = fsdp::BackwardPrefetch::BACKWARD_POST}, "BACKWARD_POST is not supported");
  refused({.sharding_strategy = fsdp::ShardingStrategy::NO_SHARD,
           .mixed_precision = fsdp::MixedPrecision{.param_dtype = at::kBFloat16}},
          "NO_SHARD (fsdp::replicate) has no mixed precision");
  refused({.sharding_strategy = fsdp::ShardingStrategy::HYBRID_SHARD, .device_mesh = fsdp::init_device_mesh({1})},
          "HYBRID_SHARD takes a 2-D device_mesh");
  refused({.device_mesh = fsdp::init_device_mesh({1, 1}, {"replicate", "shard"})},
          "a 2-D {\"replicate\", \"shard\"} mesh is HYBRID_SHARD");
  EXPECT_ERROR_CONTAINS(fsdp::size_based_auto_wrap_policy(-1), "min_num_params is -1");
  EXPECT_ERROR_CONTAINS(fsdp::transformer_auto_wrap_policy(std::vector<fsdp::ModuleType>{}), "no layer types");
}
