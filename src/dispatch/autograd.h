// Attaching a hand-written backward to outputs computed without autograd. Our ops keep their
// metadata (plans, groups) as C++ values in the node; torch::autograd::Function could only
// keep IValues.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ulysses::detail {

using BackwardFn = std::function<std::vector<at::Tensor>(std::vector<at::Tensor>&&)>;

// True inside a FunctionNode's backward that the engine frees once it returns (the graph is not
// retained): the backward may then drop what it captured as soon as it has read it (a saved
// output it needs only to begin with), as no second run will look for it.
inline thread_local bool backward_runs_once = false;

// What torch's autograd graph holds a node by: std::shared_ptr up to torch 2.11,
// c10::intrusive_ptr later. Edge::function names it on every version.
using NodePtr = decltype(torch::autograd::Edge::function);

// A new node of type T, held as the graph holds nodes.
template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// A node whose backward is `fn`; undefined incoming gradients are replaced by zeros.
class FunctionNode : public torch::autograd::Node {
 public:
  FunctionNode(std::string name, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string name() const override { return name_; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(fn_ != nullptr, name_,
                ": backward ran through this graph a second time, after "
                "its saved tensors were freed; pass retain_graph=True to the first backward");
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) grads[i] = at::zeros(shapes_[i], options_[i]);
    }
    const bool outer = backward_runs_once;  // (A backward may run other nodes' inside it.)
    backward_runs_once = released_next_;
    struct Restore {
      bool value;
      ~Restore() { backward_runs_once = value; }
    } restore{outer};
    return fn_(std::move(grads));
  }
  // Called by the engine before apply when release_variables follows it.
  void will_release_variables() override { released_next_ = true; }
  // Called by the engine once this node ran, unless the graph is retained: `fn` holds the
  // tensors backward needs (the forward's inputs and outputs), freed here as torch frees a
  // node's saved variables, not when the graph itself dies (after the whole backward).
  void release_variables() override { fn_ = nullptr; }
  void record_output(const at::Tensor& t) {
    shapes_.push_back(t.sizes().vec());
    options_.push_back(t.options());
  }

 private:
  std::string name_;
  BackwardFn fn_;               // Maps output grads to input grads; null once released.
  bool released_next_ = false;  // This apply is the last: release_variables follows it.
  std::vector<std::vector<int64_t>> shapes_;  // Output shapes, for undefined grads.
  std::vector<at::TensorOptions> options_;    // Output options, likewise.
};

// Makes `outputs` differentiable functions of `inputs` with backward `fn`, when grad mode is
// on and some input requires grad. `fn` returns one gradient per input (undefined allowed).
inline void attach_backward(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor>& outputs,
                            std::string name, BackwardFn fn) {
  if (!torch::autograd::compute_requires_grad(inputs)) return;
  auto node = make_node<FunctionNode>(std::move(name), std::move(fn));
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (at::Tensor& out : outputs) {
    node->record_output(out);
    torch::autograd::set_history(out, node);
  }
}

// Frees `t`'s bytes where nothing else holds its storage, keeping its shape: for an output of
// which only the graph is wanted from here on (a recomputed chunk's, before its backward;
// Note [Recomputed chunks]), as FSDP frees a parameter's. Storage shared with anything (a view,
// a node's saved copy) is left alone. Returns whether it freed them.
inline bool free_if_unshared(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.storage().use_count() != 1) return false;
  t.storage().unsafeGetStorageImpl()->reset();
  return true;
}

}  // namespace ulysses::detail
