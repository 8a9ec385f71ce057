// The kernels floor's dispatcher ops (registered in kernels/ops.cpp; Note [One autograd] in
// transport/ops.h): the library's call into flash_attention, and the pieces the ring's ops
// (attention/ops.cpp) share with it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <tuple>
#include <vector>

#include "ulysses/attention.h"
#include "ulysses/flash_attention.h"

namespace ulysses::detail {

std::tuple<at::Tensor, at::Tensor> call_flash_attention(const LocalAttentionArgs& args,
                                                        const FlashOptions& options);

// LocalAttentionArgs from an op's arguments (sinks: unset when undefined).
LocalAttentionArgs local_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              c10::IntArrayRef kv_map, const c10::optional<at::Tensor>& mask,
                              const c10::optional<at::Tensor>& positions,
                              const AttentionRules& rules,
                              const c10::optional<at::Tensor>& sinks = {});
// Note [Attention sinks]: a sink is one more key per head, with logit sinks[h] and value 0. On
// a finished attention (out, lse) it is a merge with an empty block (exact), and the backward
// kernels, run on the merged out and lse, give dq, dk, dv unchanged: p = exp(s - lse) are then
// the probabilities with the sink, and ds = p * (dp - rowsum(do * o)) holds as it is.
std::tuple<at::Tensor, at::Tensor> with_sinks(const at::Tensor& out, const at::Tensor& lse,
                                              const c10::optional<at::Tensor>& sinks);
// delta = rowsum(grad_out * out) over the last dim, in fp32: the row term of attention's
// backward (ds = p * (dp - delta)) and its only use of the forward's output, [.., S] for
// [.., S, Dv] in any layout whose last dim is Dv.
at::Tensor attention_delta(const at::Tensor& grad_out, const at::Tensor& out);
// attention_delta for a backward node that keeps the forward's output `out` only for it: `out`
// is dropped once read where the node runs once (backward_runs_once, dispatch/autograd.h), so
// the kernel that follows runs without it.
at::Tensor take_delta(const at::Tensor& grad_out, at::Tensor& out);
// flash_attention_backward given delta [B, Hq, Sq] (attention_delta of its grad_out and out)
// in place of the output: a caller that has delta sooner need not keep out by heads.
std::vector<at::Tensor> flash_backward_from_delta(const at::Tensor& grad_out,
                                                  const LocalAttentionArgs& args,
                                                  const at::Tensor& delta, const at::Tensor& lse,
                                                  bool mask_grad, const FlashOptions& options = {});
// d/dsinks[h] = -sum over h's rows of p_sink * delta, p_sink = exp(sinks[h] - lse), from the
// merged out's delta and lse.
at::Tensor sinks_grad(const at::Tensor& delta, const at::Tensor& lse, const at::Tensor& sinks);
bool learns_sinks(const c10::optional<at::Tensor>& sinks);
// The inputs a local attention is differentiable in: q, k, v and a learnable float mask.
std::vector<at::Tensor> attention_inputs(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v,
                                         const c10::optional<at::Tensor>& mask);

}  // namespace ulysses::detail
