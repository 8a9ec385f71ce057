// torch.ops.ulysses, the kernels floor: the fused flash attention and local attention on
// the kernel the rule picks.
// Every ops file's conventions: Note [Op files] in transport/ops.h.
#include "kernels/ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "dispatch/autograd.h"
#include "dispatch/op_util.h"
#include "ulysses/attention.h"
#include "ulysses/flash_attention.h"

namespace ulysses {
namespace detail {

LocalAttentionArgs local_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              c10::IntArrayRef kv_map, const OptTensor& mask,
                              const OptTensor& positions, const AttentionRules& rules,
                              const OptTensor& sinks) {
  LocalAttentionArgs a;
  a.set_rules(rules);
  a.q = q, a.k = k, a.v = v;
  a.kv_map = kv_map.vec();
  a.mask = mask;
  a.positions = positions;
  if (sinks && sinks->defined()) a.sinks = sinks;
  return a;
}

std::tuple<at::Tensor, at::Tensor> with_sinks(const at::Tensor& out, const at::Tensor& lse,
                                              const OptTensor& sinks) {
  if (!sinks || !sinks->defined()) return {out, lse};
  at::Tensor o = out.to(at::kFloat);
  at::Tensor logits = sinks->detach().to(at::kFloat).view({1, -1, 1}).expand_as(lse);
  auto [merged, merged_lse] = merge_attention(o, lse, at::zeros_like(o), logits);
  return {merged.to(out.scalar_type()).contiguous(), merged_lse.contiguous()};
}

at::Tensor attention_delta(const at::Tensor& grad_out, const at::Tensor& out) {
  return (grad_out.to(at::kFloat) * out.to(at::kFloat)).sum(-1);
}

at::Tensor take_delta(const at::Tensor& grad_out, at::Tensor& out) {
  at::Tensor delta = attention_delta(grad_out, out);
  if (backward_runs_once) out = at::Tensor();
  return delta;
}

at::Tensor sinks_grad(const at::Tensor& delta, const at::Tensor& lse, const at::Tensor& sinks) {
  at::Tensor p_sink = (sinks.to(at::kFloat).view({1, -1, 1}) - lse).exp();
  return (p_sink * delta).sum(at::IntArrayRef{0, 2}).neg().to(sinks.scalar_type());
}

bool learns_sinks(const OptTensor& sinks) {
  return sinks && sinks->defined() && sinks->requires_grad();
}

bool learns_mask(const OptTensor& mask) {
  return mask && mask->defined() && mask->is_floating_point() && mask->requires_grad();
}

std::vector<at::Tensor> attention_inputs(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const OptTensor& mask) {
  std::vector<at::Tensor> inputs{q, k, v};
  if (learns_mask(mask)) inputs.push_back(*mask);
  return inputs;
}

}  // namespace detail

namespace {

using namespace detail;  // NOLINT: this floor's op helpers.

// The flash op's `rows`: [q_index, k_index] or [q_index, k_index, q_docs, k_docs] (GlobalRows),
// or none.
c10::optional<GlobalRows> rows_of(at::TensorList rows) {
  if (rows.empty()) return c10::nullopt;
  TORCH_CHECK_VALUE(rows.size() == 2 || rows.size() == 4,
                    "flash_attention: rows must be [q_index, k_index] or [q_index, k_index, "
                    "q_docs, k_docs]; got ",
                    rows.size(), " tensors");
  GlobalRows r;
  r.q_index = rows[0], r.k_index = rows[1];
  if (rows.size() == 4) r.q_docs = rows[2], r.k_docs = rows[3];
  return r;
}

std::vector<at::Tensor> rows_list(const c10::optional<GlobalRows>& rows) {
  if (!rows) return {};
  std::vector<at::Tensor> out{rows->q_index, rows->k_index};
  if (rows->q_docs.defined()) out.insert(out.end(), {rows->q_docs, rows->k_docs});
  return out;
}

std::tuple<at::Tensor, at::Tensor> flash_attention_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::IntArrayRef kv_map,
    const OptTensor& mask, const OptTensor& positions, bool causal, double scale,
    at::TensorList rows, int64_t block_q, int64_t block_k, int64_t window, double softcap,
    const OptTensor& sinks) {
  LocalAttentionArgs a =
      local_args(q, k, v, kv_map, mask, positions, op_rules(causal, scale, window, softcap));
  a.rows = rows_of(rows);
  check_sinks(sinks, q.size(1));
  auto [out, lse] = flash_attention_forward(a, FlashOptions{block_q, block_k});
  return with_sinks(out.contiguous(), lse.contiguous(), sinks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& delta, const at::Tensor& lse, c10::IntArrayRef kv_map, const OptTensor& mask,
    const OptTensor& positions, bool causal, double scale, bool mask_grad, at::TensorList rows,
    int64_t block_q, int64_t block_k, int64_t window, double softcap) {
  LocalAttentionArgs a =
      local_args(q, k, v, kv_map, mask, positions, op_rules(causal, scale, window, softcap));
  a.rows = rows_of(rows);
  auto g =
      flash_backward_from_delta(grad_out, a, delta, lse, mask_grad, FlashOptions{block_q, block_k});
  // No mask gradient: an empty tensor (a dispatcher op cannot return an undefined one).
  if (!g[3].defined()) g[3] = at::empty({0}, q.options());
  return {g[0].contiguous(), g[1].contiguous(), g[2].contiguous(), g[3].contiguous()};
}

std::tuple<at::Tensor, at::Tensor> flash_attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::IntArrayRef kv_map,
    const OptTensor& mask, const OptTensor& positions, bool causal, double scale,
    at::TensorList rows, int64_t block_q, int64_t block_k, int64_t window, double softcap,
    const OptTensor& sinks) {
  static const auto op = op_handle<decltype(flash_attention_op)>("ulysses::flash_attention");
  static const auto backward =
      op_handle<decltype(flash_attention_backward_op)>("ulysses::flash_attention_backward");
  auto [out, lse] = below_autograd([&] {
    return op.call(q, k, v, kv_map, mask, positions, causal, scale, rows, block_q, block_k, window,
                   softcap, sinks);
  });
  std::vector<at::Tensor> inputs = attention_inputs(q, k, v, mask);
  const bool mask_grad = inputs.size() == 4, sink_grad = learns_sinks(sinks);
  if (sink_grad) inputs.push_back(*sinks);
  if (!needs_grad(inputs)) return {out, lse};
  std::vector<at::Tensor> outs{out};
  detail::attach_backward(
      inputs, outs, "FlashAttentionBackward",
      [q = q.detach(), k = k.detach(), v = v.detach(), o = out.detach(), lse, map = kv_map.vec(),
       mask = detached(mask), positions, causal, scale, mask_grad, block_q, block_k, window,
       softcap, rows = rows.vec(), sinks = detached(sinks),
       sink_grad](std::vector<at::Tensor>&& g) mutable {
        // o is read only as delta: it goes before the kernel runs (o by heads is as large as q).
        const at::Tensor delta = take_delta(g[0], o);
        auto [dq, dk, dv, dmask] =
            backward.call(g[0], q, k, v, delta, lse, map, mask, positions, causal, scale, mask_grad,
                          rows, block_q, block_k, window, softcap);
        std::vector<at::Tensor> grads{dq, dk, dv};
        if (mask_grad) grads.push_back(dmask);
        if (sink_grad) grads.push_back(sinks_grad(delta, lse, *sinks));
        return grads;
      });
  return {outs[0], lse};
}

at::Tensor local_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              c10::IntArrayRef kv_map, const OptTensor& mask,
                              const OptTensor& positions, bool causal, double scale,
                              const std::string& kernel, int64_t window, double softcap,
                              const OptTensor& sinks) {
  return local_attention(
      local_args(q, k, v, kv_map, mask, positions, op_rules(causal, scale, window, softcap), sinks),
      parse_local_kernel(kernel));
}

}  // namespace

namespace detail {

std::tuple<at::Tensor, at::Tensor> call_flash_attention(const LocalAttentionArgs& a,
                                                        const FlashOptions& options) {
  static const auto op = op_handle<decltype(flash_attention_op)>("ulysses::flash_attention");
  return op.call(a.q, a.k, a.v, a.kv_map, a.mask, a.positions, a.causal, a.scale, rows_list(a.rows),
                 options.block_q, options.block_k, a.window, a.softcap, a.sinks);
}

}  // namespace detail

TORCH_LIBRARY_FRAGMENT(ulysses, m) {
  const std::vector<at::Tag> pt2{at::Tag::pt2_compliant_tag};
  m.def(
      "flash_attention(Tensor q, Tensor k, Tensor v, int[] kv_map, Tensor? mask, "
      "Tensor? positions, bool causal, float scale, Tensor[] rows, int block_q=0, "
      "int block_k=0, int window=0, float softcap=0., Tensor? sinks=None) -> (Tensor, Tensor)",
      pt2);
  m.def(
      "flash_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor delta, "
      "Tensor lse, int[] kv_map, Tensor? mask, Tensor? positions, bool causal, float scale, "
      "bool mask_grad, Tensor[] rows, int block_q=0, int block_k=0, int window=0, float "
      "softcap=0.) -> "
      "(Tensor, Tensor, Tensor, Tensor)",
      pt2);
  // Local attention on the exact kernel `kernel` picks ("auto": the rule in attention.h).
  m.def(
      "local_attention(Tensor q, Tensor k, Tensor v, int[] kv_map, Tensor? mask, "
      "Tensor? positions, bool causal, float scale, str kernel=\"auto\", int window=0, float "
      "softcap=0., Tensor? sinks=None) -> Tensor",
      pt2);
}

// The fused kernel is CPU code (other devices take SDPA: the local-attention rule).
TORCH_LIBRARY_IMPL(ulysses, CPU, m) {
  m.impl("flash_attention", &flash_attention_op);
  m.impl("flash_attention_backward", &flash_attention_backward_op);
}

TORCH_LIBRARY_IMPL(ulysses, Autograd, m) { m.impl("flash_attention", &flash_attention_autograd); }

TORCH_LIBRARY_IMPL(ulysses, CompositeImplicitAutograd, m) {
  m.impl("local_attention", &local_attention_op);
}

}  // namespace ulysses
