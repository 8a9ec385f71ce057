// torch.ops.ulysses, the attention floor: masks rebuilt for local attention, ring attention,
// and the one orchestration (Note [One orchestration]) as the attention ops.
// Every ops file's conventions: Note [Op files] in transport/ops.h.
#include "attention/ops.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "attention/orchestration.h"
#include "dispatch/autograd.h"
#include "dispatch/op_util.h"
#include "kernels/ops.h"
#include "transport/op_options.h"
#include "transport/ops.h"
#include "ulysses/distributed_attention.h"
#include "ulysses/mask.h"
#include "ulysses/ring_attention.h"

namespace ulysses {
namespace {

using namespace detail;  // NOLINT: the op helpers and the kernels floor's sink rules.

// torch.classes.ulysses.StepContext: a StepContext made on its first use, for that call's group.
struct StepContextHolder : torch::CustomClassHolder {
  StepContext& context_for(const Group& group) {
    if (!context) context.emplace(group);
    return *context;
  }
  int64_t reuses() const { return context ? context->reuses() : 0; }
  int64_t agreements_reused() const { return context ? context->agreements_reused() : 0; }
  c10::optional<StepContext> context;
};

using StepHandle = c10::optional<c10::intrusive_ptr<StepContextHolder>>;

at::Tensor rebuild_mask_op(const at::Tensor& mask, int64_t q_heads, int64_t kv_heads,
                           c10::IntArrayRef seq_lens, const std::string& group_name,
                           c10::IntArrayRef group_options, int64_t key_len) {
  const Group group = group_of_op(group_name, group_options);
  const Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, "BHSD", group.size());
  return unaliased(as_4d_mask(detail::rebuild_mask_kernel(mask, sharding, group, key_len)), {mask});
}

at::Tensor rebuild_mask_backward_op(const at::Tensor& grad, c10::IntArrayRef mask_sizes,
                                    int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                                    const std::string& group_name, c10::IntArrayRef group_options,
                                    int64_t key_len) {
  const Group group = group_of_op(group_name, group_options);
  const Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, "BHSD", group.size());
  at::NoGradGuard no_grad;
  return unaliased(rebuild_mask_backward(grad, mask_sizes.vec(), sharding, group, key_len), {grad});
}

at::Tensor rebuild_mask_autograd(const at::Tensor& mask, int64_t q_heads, int64_t kv_heads,
                                 c10::IntArrayRef seq_lens, const std::string& group_name,
                                 c10::IntArrayRef group_options, int64_t key_len) {
  static const auto op = op_handle<decltype(rebuild_mask_op)>("ulysses::rebuild_mask");
  static const auto backward =
      op_handle<decltype(rebuild_mask_backward_op)>("ulysses::rebuild_mask_backward");
  std::vector<at::Tensor> outs{below_autograd([&] {
    return op.call(mask, q_heads, kv_heads, seq_lens, group_name, group_options, key_len);
  })};
  if (!needs_grad({mask})) return outs[0];
  detail::attach_backward(
      {mask}, outs, "RebuildMaskBackward",
      [sizes = mask.sizes().vec(), q_heads, kv_heads, seq = seq_lens.vec(), group_name,
       options = group_options.vec(), key_len](std::vector<at::Tensor>&& g) {
        return std::vector<at::Tensor>{
            backward.call(g[0], sizes, q_heads, kv_heads, seq, group_name, options, key_len)};
      });
  return outs[0];
}

std::tuple<at::Tensor, at::Tensor> ring_attention_op(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, c10::IntArrayRef kv_map,
                                                     const OptTensor& mask, const OptTensor& docs,
                                                     bool causal, double scale, int64_t seq_len,
                                                     int64_t ulysses, const std::string& ring_group,
                                                     c10::IntArrayRef group_options, int64_t window,
                                                     double softcap, const OptTensor& sinks) {
  const Group ring = group_of_op(ring_group, group_options);
  const RingLayout layout = RingLayout::make(seq_len, ulysses, ring.size());
  check_sinks(sinks, q.size(1));
  // Eager only (no fake kernel): the outputs keep the kernel's strides, which the backward's
  // row sums read in the same order as the forward wrote them. Sinks join the merged result
  // once (Note [Attention sinks]).
  auto [out, lse] = ring_attention_forward(
      local_args(q, k, v, kv_map, mask, {}, op_rules(causal, scale, window, softcap)), layout,
      docs.value_or(at::Tensor()), ring);
  return with_sinks(out, lse, sinks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ring_attention_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& delta, const at::Tensor& lse, c10::IntArrayRef kv_map, const OptTensor& mask,
    const OptTensor& docs, bool causal, double scale, int64_t seq_len, int64_t ulysses,
    const std::string& ring_group, c10::IntArrayRef group_options, bool mask_grad, int64_t window,
    double softcap) {
  const Group ring = group_of_op(ring_group, group_options);
  const RingLayout layout = RingLayout::make(seq_len, ulysses, ring.size());
  auto g = ring_backward_from_delta(
      grad_out, local_args(q, k, v, kv_map, mask, {}, op_rules(causal, scale, window, softcap)),
      layout, docs.value_or(at::Tensor()), ring, delta, lse, mask_grad);
  if (!g[3].defined()) g[3] = at::empty({0}, q.options());
  return {g[0].contiguous(), g[1].contiguous(), g[2].contiguous(), g[3].contiguous()};
}

std::tuple<at::Tensor, at::Tensor> ring_attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::IntArrayRef kv_map,
    const OptTensor& mask, const OptTensor& docs, bool causal, double scale, int64_t seq_len,
    int64_t ulysses, const std::string& ring_group, c10::IntArrayRef group_options, int64_t window,
    double softcap, const OptTensor& sinks) {
  static const auto op = op_handle<decltype(ring_attention_op)>("ulysses::ring_attention");
  static const auto backward =
      op_handle<decltype(ring_attention_backward_op)>("ulysses::ring_attention_backward");
  auto [out, lse] = below_autograd([&] {
    return op.call(q, k, v, kv_map, mask, docs, causal, scale, seq_len, ulysses, ring_group,
                   group_options, window, softcap, sinks);
  });
  std::vector<at::Tensor> inputs = attention_inputs(q, k, v, mask);
  const bool mask_grad = inputs.size() == 4, sink_grad = learns_sinks(sinks);
  if (sink_grad) inputs.push_back(*sinks);
  if (!needs_grad(inputs)) return {out, lse};
  std::vector<at::Tensor> outs{out};
  detail::attach_backward(
      inputs, outs, "RingAttentionBackward",
      [q = q.detach(), k = k.detach(), v = v.detach(), o = out.detach(), lse, map = kv_map.vec(),
       mask = detached(mask), docs, causal, scale, seq_len, ulysses, ring_group,
       options = group_options.vec(), mask_grad, window, softcap, sinks = detached(sinks),
       sink_grad](std::vector<at::Tensor>&& g) mutable {
        // o is read only as delta: it goes before the ring runs.
        const at::Tensor delta = take_delta(g[0], o);
        auto [dq, dk, dv, dmask] =
            backward.call(g[0], q, k, v, delta, lse, map, mask, docs, causal, scale, seq_len,
                          ulysses, ring_group, options, mask_grad, window, softcap);
        std::vector<at::Tensor> grads{dq, dk, dv};
        if (mask_grad) grads.push_back(dmask);
        if (sink_grad) grads.push_back(sinks_grad(delta, lse, *sinks));
        return grads;
      });
  return {outs[0], lse};
}

at::Tensor ring_document_ids_op(const at::Tensor& positions, int64_t seq_len, int64_t ulysses,
                                const std::string& ring_group, c10::IntArrayRef group_options) {
  const Group ring = group_of_op(ring_group, group_options);
  at::NoGradGuard no_grad;
  return unaliased(
      ring_document_ids(positions, RingLayout::make(seq_len, ulysses, ring.size()), ring),
      {positions});
}

// Everything but the tensors of one `attention` op call, as the C++ orchestration takes it.
AttentionCall attention_call(int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                             const std::string& layout, bool causal, double scale,
                             const std::string& local, const std::string& group_name,
                             c10::IntArrayRef group_options,
                             const c10::optional<std::string>& ring_group, const StepHandle& step,
                             bool mask_rebuilt, int64_t window, double softcap,
                             const OptTensor& sinks) {
  AttentionCall call(group_of_op(group_name, group_options));
  if (ring_group) call.ring = group_of_op(*ring_group, group_options);
  call.q_heads = q_heads;
  call.kv_heads = kv_heads;
  if (!seq_lens.empty()) call.seq = SequencePartition::from_lengths(seq_lens.vec());
  call.layout = parse_layout(layout);
  call.rules() = op_rules(causal, scale, window, softcap);
  if (sinks && sinks->defined()) call.sinks = sinks;
  call.kernel = parse_local_kernel(local);
  if (step && *step) call.step = &(*step)->context_for(call.group);
  call.mask_form = mask_rebuilt ? MaskForm::kRebuilt : MaskForm::kAsGiven;
  return call;
}

at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const OptTensor& mask, const OptTensor& positions, int64_t q_heads,
                        int64_t kv_heads, c10::IntArrayRef seq_lens, const std::string& layout,
                        bool causal, double scale, const std::string& local,
                        const std::string& group_name, c10::IntArrayRef group_options,
                        const c10::optional<std::string>& ring_group, const StepHandle& step,
                        bool mask_rebuilt, int64_t window, double softcap, const OptTensor& sinks,
                        int64_t head_chunks, bool recompute_chunks) {
  const AttentionCall call =
      attention_call(q_heads, kv_heads, seq_lens, layout, causal, scale, local, group_name,
                     group_options, ring_group, step, mask_rebuilt, window, softcap, sinks);
  if (head_chunks > 1 || recompute_chunks) {
    AttentionInputs in;
    in.mask = mask, in.positions = positions;
    return attend_in_head_chunks(call, q, k, v, in, head_chunks, recompute_chunks);
  }
  return attend(call, {{q}, {k}, {v}}, HeadForm::kWhole, mask, positions)[0];
}

std::vector<at::Tensor> attention_parts_op(
    at::TensorList q, at::TensorList k, at::TensorList v, const OptTensor& mask,
    const OptTensor& positions, int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
    const std::string& layout, bool causal, double scale, const std::string& local,
    const std::string& group_name, c10::IntArrayRef group_options,
    const c10::optional<std::string>& ring_group, const StepHandle& step, bool mask_rebuilt,
    int64_t window, double softcap, const OptTensor& sinks) {
  const AttentionCall call =
      attention_call(q_heads, kv_heads, seq_lens, layout, causal, scale, local, group_name,
                     group_options, ring_group, step, mask_rebuilt, window, softcap, sinks);
  return attend(call, {q.vec(), k.vec(), v.vec()}, HeadForm::kParts, mask, positions);
}

// The orchestration up to local attention, for a local attention of the caller's (a Python
// callable, or flex): [q, k, v] on this rank's heads over the whole sequence (BHSD), then the
// rebuilt mask, the gathered position ids and this rank's heads' sinks, each where given, but
// the position ids not where they split no row into documents (then they add no rule).
std::vector<at::Tensor> attention_heads_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
    const OptTensor& positions, int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
    const std::string& layout, bool causal, double scale, const std::string& group_name,
    c10::IntArrayRef group_options, const StepHandle& step, bool mask_rebuilt, int64_t window,
    double softcap, const OptTensor& sinks) {
  AttentionCall call =
      attention_call(q_heads, kv_heads, seq_lens, layout, causal, scale, "auto", group_name,
                     group_options, c10::nullopt, step, mask_rebuilt, window, softcap, sinks);
  call.local_by = LocalBy::kCaller;
  const AttentionHeads h = attend_heads(call, {{q}, {k}, {v}}, HeadForm::kWhole, mask, positions);
  std::vector<at::Tensor> out{h.args.q, h.args.k, h.args.v};
  if (h.args.mask) out.push_back(*h.args.mask);
  if (h.args.positions) out.push_back(*h.args.positions);
  if (h.args.sinks) out.push_back(*h.args.sinks);
  return out;
}

}  // namespace

namespace detail {

at::Tensor call_rebuild_mask(const at::Tensor& mask, const Sharding& sharding, const Group& group,
                             int64_t key_len) {
  static const auto op = op_handle<decltype(rebuild_mask_op)>("ulysses::rebuild_mask");
  return op.call(mask, sharding.heads.q_heads(), sharding.heads.kv_heads(), sharding.seq.lengths(),
                 op_group_name(group), options_to_ints(group.options()), key_len);
}

std::tuple<at::Tensor, at::Tensor> call_ring_attention(const LocalAttentionArgs& a,
                                                       const RingLayout& layout,
                                                       const at::Tensor& docs, const Group& ring) {
  static const auto op = op_handle<decltype(ring_attention_op)>("ulysses::ring_attention");
  TORCH_CHECK_VALUE(!a.positions && !a.rows,
                    "ring_attention: packed documents come as `docs` (ring_document_ids)");
  return op.call(a.q, a.k, a.v, a.kv_map, a.mask, docs.defined() ? OptTensor(docs) : OptTensor(),
                 a.causal, a.scale, layout.seq_len(), layout.ulysses(), op_group_name(ring),
                 options_to_ints(ring.options()), a.window, a.softcap, a.sinks);
}

}  // namespace detail

TORCH_LIBRARY_FRAGMENT(ulysses, m) {
  m.class_<StepContextHolder>("StepContext")
      .def(torch::init<>())
      .def("reuses", &StepContextHolder::reuses)
      .def("agreements_reused", &StepContextHolder::agreements_reused);
  const std::vector<at::Tag> pt2{at::Tag::pt2_compliant_tag};
  m.def(
      "rebuild_mask(Tensor mask, int q_heads, int kv_heads, int[] seq_lens, str group, "
      "int[] group_options, int key_len=-1) -> Tensor",
      pt2);
  m.def(
      "rebuild_mask_backward(Tensor grad, int[] mask_sizes, int q_heads, int kv_heads, "
      "int[] seq_lens, str group, int[] group_options, int key_len=-1) -> Tensor",
      pt2);
  // Ring attention over `ring_group` for this ring rank's tokens of RingLayout(seq_len,
  // ulysses, ring size); docs: [B or 1, seq_len] global document ids.
  m.def(
      "ring_attention(Tensor q, Tensor k, Tensor v, int[] kv_map, Tensor? mask, Tensor? docs, "
      "bool causal, float scale, int seq_len, int ulysses, str ring_group, int[] group_options, "
      "int window=0, float softcap=0., Tensor? sinks=None) -> (Tensor, Tensor)");
  m.def(
      "ring_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor delta, "
      "Tensor lse, int[] kv_map, Tensor? mask, Tensor? docs, bool causal, float scale, "
      "int seq_len, int ulysses, str ring_group, int[] group_options, bool mask_grad, "
      "int window=0, float softcap=0.) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ring_document_ids(Tensor positions, int seq_len, int ulysses, str ring_group, "
      "int[] group_options) -> Tensor");
  // One DistributedAttention call (distributed_attention.h): empty seq_lens are learned in the
  // call's agreement (eager only); `step` shares rebuilt masks across layers (eager only);
  // `mask_rebuilt`: the mask is already rebuild_mask's output for these heads.
  const char* call_args =
      "Tensor? mask, Tensor? positions, int q_heads, int kv_heads, int[] seq_lens, str layout, "
      "bool causal, float scale, str local, str group, int[] group_options, "
      "str? ring_group=None, __torch__.torch.classes.ulysses.StepContext? step=None, "
      "bool mask_rebuilt=False, int window=0, float softcap=0., Tensor? sinks=None";
  // head_chunks > 1 or recompute_chunks: attend_in_head_chunks (eager; Python chunks a traced
  // call itself).
  static const std::string attention =
      std::string("attention(Tensor q, Tensor k, Tensor v, ") + call_args +
      ", int head_chunks=1, bool recompute_chunks=False) -> Tensor";
  static const std::string attention_parts =
      std::string("attention_parts(Tensor[] q, Tensor[] k, Tensor[] v, ") + call_args +
      ") -> Tensor[]";
  m.def(attention.c_str());
  m.def(attention_parts.c_str());
  m.def(
      "attention_heads(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? positions, "
      "int q_heads, int kv_heads, int[] seq_lens, str layout, bool causal, float scale, "
      "str group, int[] group_options, __torch__.torch.classes.ulysses.StepContext? step=None, "
      "bool mask_rebuilt=False, int window=0, float softcap=0., Tensor? sinks=None) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(ulysses, CompositeExplicitAutograd, m) {
  m.impl("rebuild_mask", &rebuild_mask_op);
  m.impl("rebuild_mask_backward", &rebuild_mask_backward_op);
  m.impl("ring_document_ids", &ring_document_ids_op);
}

// The ring computes on the fused kernel: CPU code.
TORCH_LIBRARY_IMPL(ulysses, CPU, m) {
  m.impl("ring_attention", &ring_attention_op);
  m.impl("ring_attention_backward", &ring_attention_backward_op);
}

TORCH_LIBRARY_IMPL(ulysses, Autograd, m) {
  m.impl("rebuild_mask", &rebuild_mask_autograd);
  m.impl("ring_attention", &ring_attention_autograd);
}

// The orchestration: composite, so eager runs it through the ops it calls and torch.compile
// traces those ops (their fake kernels and autograd).
TORCH_LIBRARY_IMPL(ulysses, CompositeImplicitAutograd, m) {
  m.impl("attention", &attention_op);
  m.impl("attention_parts", &attention_parts_op);
  m.impl("attention_heads", &attention_heads_op);
}

}  // namespace ulysses
