#include "autograd_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <new>

#include "fsdp/compat/autograd_node.h"
#include "fsdp_state.h"

namespace fsdp::detail {

namespace {

// [Note: recycled hook memory]
// The post-backward node and the pre-backward hook objects are made once per unit and forward and
// freed with the graph, after backward. Their memory goes to a free list of blocks of its size
// instead of back to the heap, and the next forward's objects are made in it: no heap allocation
// in a steady step. The objects themselves are new each time (a node's sequence number, which
// orders the engine's ready queue, is taken in its constructor). A mutex: a graph may be freed on
// another thread than the one that built it. The lists are never destroyed (a graph may outlive
// static destruction) and keep at most kMaxKept blocks each (the peak of a step's live objects).
class FreeList {
 public:
  explicit FreeList(size_t size) : size_(size) { blocks_.reserve(kMaxKept); }
  void* take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!blocks_.empty()) {
        void* block = blocks_.back();
        blocks_.pop_back();
        return block;
      }
    }
    return ::operator new(size_);
  }
  void give(void* block) noexcept {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (blocks_.size() < kMaxKept) {  // reserved: push_back does not allocate
        blocks_.push_back(block);
        return;
      }
    }
    ::operator delete(block);
  }

 private:
  static constexpr size_t kMaxKept = 4096;
  const size_t size_;
  std::mutex mu_;
  std::vector<void*> blocks_;
};

template <size_t Size>
FreeList& free_list() {
  static auto* list = new FreeList(Size);  // never destroyed (above)
  return *list;
}

// Class-wide operator new/delete from the free list of T's size: for objects LibTorch frees with
// `delete` (a node owned by c10::intrusive_ptr, a hook owned by std::unique_ptr).
template <typename T>
struct Recycled {
  static void* operator new(size_t size) {
    TORCH_INTERNAL_ASSERT(size == sizeof(T));
    return free_list<sizeof(T)>().take();
  }
  static void operator delete(void* block) noexcept { free_list<sizeof(T)>().give(block); }
};

// The allocator of std::allocate_shared for a node owned by std::shared_ptr: the one block of the
// node and its count (a type of its own size) from that size's free list.
template <typename T>
struct RecycledAllocator {
  using value_type = T;
  RecycledAllocator() = default;
  template <typename U>
  RecycledAllocator(const RecycledAllocator<U>&) noexcept {}
  T* allocate(size_t n) {
    static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
    return static_cast<T*>(n == 1 ? free_list<sizeof(T)>().take() : ::operator new(n * sizeof(T)));
  }
  void deallocate(T* block, size_t n) noexcept {
    if (n == 1) {
      free_list<sizeof(T)>().give(block);
    } else {
      ::operator delete(block);
    }
  }
  template <typename U>
  bool operator==(const RecycledAllocator<U>&) const noexcept {
    return true;
  }
};

// [Note: the post-backward node]
// FSDP2's RegisterPostBackwardFunction is an identity autograd Function on a unit's inputs: its
// backward runs once the gradients of everything the unit computed from them exist, that is after
// the unit's backward. torch::autograd::Function<T>::apply builds that node with the bookkeeping a
// general custom Function needs (a context with a saved-data map, input and output descriptions
// with their sizes, sets of dirty and non-differentiable tensors, a copy of each list), a few dozen
// heap allocations per unit and step, and as many again in its backward. The node below is the
// same identity with only what it uses: its edges to the inputs' gradient functions, one input
// description per output (the engine checks the gradients' shapes against them), and the outputs
// made as Function::apply makes an input returned unchanged (a view of it taken without grad mode,
// whose gradient function is this node, marked as created in a custom Function so an in-place
// change of it fails the same way). Its backward, like a C++ Function's with materialized
// gradients (the default), turns an undefined gradient into zeros and passes the gradients through.
// Its memory and its count's are recycled ([Note: recycled hook memory]): allocator_type and
// operator new/delete serve compat::make_autograd_node's two forms.
struct PostBackwardNode final : torch::autograd::Node, Recycled<PostBackwardNode> {
  using allocator_type = RecycledAllocator<PostBackwardNode>;
  using Recycled<PostBackwardNode>::operator new;
  using Recycled<PostBackwardNode>::operator delete;
  explicit PostBackwardNode(FSDPState* state) : state_(state) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    state_->post_backward();
    torch::autograd::variable_list out(std::move(grads));
    for (size_t i = 0; i < out.size(); ++i) {
      if (!out[i].defined()) out[i] = input_metadata(i).zeros_like();
    }
    return out;
  }
  std::string name() const override { return "fsdp::PostBackward"; }

 private:
  FSDPState* state_;
};

bool takes_grad(const at::Tensor& t) { return t.defined() && t.requires_grad() && at::isFloatingType(t.scalar_type()); }

// Pre-backward as a pre-hook of the node that produced an output: it runs when that node runs,
// which is when a tensor hook on the output would (the engine runs a tensor's hooks from the same
// place), in registration order with the user's tensor hooks on that output as FSDP2's tensor hooks
// run (compat::add_output_pre_hook: on 2.x a tensor pre-hook of the node), and registering it is
// one small object on the node instead of a tensor hook's std::function, hook list and two hook
// objects. pre_backward runs once per unit and step, so outputs of one node share a hook.
//
// The hook interface takes the gradients by const reference and returns the list to use, which
// would be a copy of it (a heap allocation per unit and step) for a hook that changes nothing.
// Every caller of a node's pre-hooks and tensor pre-hooks in LibTorch's engine (1.13 and 2.x:
// call_pre_hooks, call_tensor_pre_hooks) holds the list in a non-const variable and assigns the
// result back to it, `inputs = (*hook)(inputs)`, so the hook moves the list out instead: the
// caller's variable gets its own buffer back. The hook's memory is recycled ([Note: recycled hook
// memory]).
struct PreBackwardHook final : torch::autograd::FunctionPreHook, Recycled<PreBackwardHook> {
  using Recycled<PreBackwardHook>::operator new;
  using Recycled<PreBackwardHook>::operator delete;
  explicit PreBackwardHook(FSDPState* state) : state_(state) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    state_->pre_backward();
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the engine's own variable (above)
    return std::move(const_cast<torch::autograd::variable_list&>(grads));
  }

 private:
  FSDPState* state_;
};

}  // namespace

std::vector<at::Tensor> register_post_backward_hook(FSDPState* state, std::vector<at::Tensor> args) {
  if (!torch::GradMode::is_enabled()) return args;
  // [Note: the post-backward node]
  c10::SmallVector<size_t, 4> where;
  for (size_t i = 0; i < args.size(); ++i) {
    if (takes_grad(args[i])) where.push_back(i);
  }
  if (where.empty()) return args;  // the final callback covers this unit
  // One allocation for the node and its count (compat/autograd_node.h): without
  // torch::autograd::deleteNode, which only keeps long chains of nodes from being freed
  // recursively; this node frees the nodes it points to through theirs.
  auto node = compat::make_autograd_node<PostBackwardNode>(state);
  {
    torch::autograd::edge_list edges;
    edges.reserve(where.size());
    for (size_t i : where) edges.push_back(torch::autograd::impl::gradient_edge(args[i]));
    node->set_next_edges(std::move(edges));
  }
  for (size_t i : where) {
    at::Tensor out;
    {
      at::AutoGradMode no_grad(false);
      out = args[i].view_as(args[i]);
    }
    const uint32_t output_nr = node->add_input_metadata(out);
    torch::autograd::impl::set_gradient_edge(out, {node, output_nr});
    if (auto* view = torch::autograd::impl::get_view_autograd_meta(out); view && view->has_bw_view()) {
      view->set_creation_meta(torch::autograd::CreationMeta::IN_CUSTOM_FUNCTION);
    }
    args[i] = std::move(out);
  }
  return args;
}

void register_pre_backward_hooks(FSDPState* state, const std::vector<at::Tensor>& outputs) {
  if (!torch::GradMode::is_enabled()) return;
  c10::SmallVector<const torch::autograd::Node*, 4> hooked;
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    const auto& node = t.grad_fn();
    if (!node) {  // a leaf returned as an output: a tensor hook (on its gradient accumulator)
      at::Tensor(t).register_hook([state](const at::Tensor&) { state->pre_backward(); });
      continue;
    }
    if (std::find(hooked.begin(), hooked.end(), node.get()) != hooked.end()) continue;
    compat::add_output_pre_hook(*node, std::make_unique<PreBackwardHook>(state));
    hooked.push_back(node.get());
  }
}

void queue_final_callback(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

std::shared_ptr<void> register_grad_accumulated_hook(const at::Tensor& leaf, std::function<void()> hook) {
  auto node = torch::autograd::impl::grad_accumulator(leaf);
  node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [hook = std::move(hook)](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
        hook();
        return outputs;
      }));
  return std::make_shared<decltype(node)>(std::move(node));
}

}  // namespace fsdp::detail
