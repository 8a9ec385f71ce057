// What every floor's op registration shares: argument conversions, the output contract, and
// running an op's kernel below autograd (Note [One autograd] in transport/ops.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Optional.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <string>
#include <vector>

#include "ulysses/attention_rules.h"
#include "ulysses/exchange_plan.h"

namespace ulysses::detail {

using Strings = c10::ArrayRef<std::string>;
using OptTensor = c10::optional<at::Tensor>;
using OptTensors = c10::List<c10::optional<at::Tensor>>;

// The ops' codec of head kinds: "q" and "kv" (Python writes them).
inline std::vector<Heads> parse_heads(Strings names) {
  std::vector<Heads> tensor_heads;
  for (const std::string& n : names) {
    TORCH_CHECK_VALUE(n == "q" || n == "kv", "ulysses: head kind must be 'q' or 'kv'; got '", n,
                      "'");
    tensor_heads.push_back(n == "q" ? Heads::kQuery : Heads::kKeyValue);
  }
  return tensor_heads;
}

inline std::string heads_arg(Heads heads) { return heads == Heads::kQuery ? "q" : "kv"; }

inline std::vector<std::string> heads_args(const std::vector<Heads>& tensor_heads) {
  std::vector<std::string> names;
  for (Heads h : tensor_heads) names.push_back(heads_arg(h));
  return names;
}

// The call's rules from an op's arguments: the one place they become the value.
inline AttentionRules op_rules(bool causal, double scale, int64_t window, double softcap) {
  AttentionRules rules;
  rules.causal = causal;
  rules.scale = scale;
  rules.window = window;
  rules.softcap = softcap;
  return rules;
}

// Outputs of an op must not alias its inputs (the single-rank paths return them as they are)
// and are contiguous, as the fake kernels promise the compiler.
inline at::Tensor unaliased(const at::Tensor& out, c10::ArrayRef<at::Tensor> inputs) {
  for (const at::Tensor& in : inputs)
    if (in.defined() && out.is_alias_of(in)) return out.clone(at::MemoryFormat::Contiguous);
  return out.contiguous();
}

inline std::vector<at::Tensor> unaliased(std::vector<at::Tensor> outs,
                                         c10::ArrayRef<at::Tensor> inputs) {
  for (at::Tensor& o : outs) o = unaliased(o, inputs);
  return outs;
}

// Runs `kernel` below autograd (the op's own kernel, or its fake kernel under a compiler).
template <typename Fn>
auto below_autograd(Fn&& kernel) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return kernel();
}

inline bool needs_grad(c10::ArrayRef<at::Tensor> inputs) {
  return torch::autograd::compute_requires_grad(inputs);
}

// The typed handle of op `name` ("ulysses::...").
template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Detached copies of what a backward node keeps: saving an output itself would make a cycle
// (out -> grad_fn -> node -> out) and leak every step's graph.
inline OptTensor detached(const OptTensor& t) {
  return t && t->defined() ? OptTensor(t->detach()) : OptTensor();
}

}  // namespace ulysses::detail
