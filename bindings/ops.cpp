// torch.ops.ulysses: the core's operations registered with PyTorch's dispatcher.
//
// Each op takes the process group as its torch.distributed group name (a string, as torch's
// functional collectives do), so torch.compile can trace calls to it. The kernels here run
// without autograd; python/ulysses/ops.py registers each op's autograd formula (the adjoint
// op) and its fake kernel. Outputs never alias inputs (a dispatcher op contract).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <vector>

#include "ulysses/all_to_all.h"
#include "ulysses/flash_attention.h"
#include "ulysses/group.h"
#include "ulysses/mask.h"
#include "ulysses/partition.h"
#include "ulysses/ring_attention.h"

namespace ulysses {
namespace {

Group group_of(const std::string& name, int64_t timeout_ms) {
  GroupOptions options;
  options.timeout = std::chrono::milliseconds(timeout_ms);
  return Group::resolve(name, options);
}

std::vector<Heads> parse_heads(c10::ArrayRef<std::string> names) {
  std::vector<Heads> kinds;
  for (const std::string& n : names) {
    TORCH_CHECK_VALUE(n == "q" || n == "kv", "ulysses: head kind must be 'q' or 'kv'; got '", n,
                      "'");
    kinds.push_back(n == "q" ? Heads::kQuery : Heads::kKeyValue);
  }
  return kinds;
}

AllToAllPlan plan_of(int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                     const std::string& layout, const Group& group) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(seq_lens.size()) == group.size(),
                    "ulysses: seq_lens must have one entry per rank (", group.size(), "); got ",
                    seq_lens.size());
  return AllToAllPlan{HeadPartition::make(q_heads, kv_heads, group.size()),
                      SequencePartition::from_lengths(seq_lens.vec()), parse_layout(layout)};
}

// Runs `prepare` (argument parsing that can fail on one rank only); a failure is raised on
// every rank through Group::fail_together.
template <typename Fn>
auto fail_together_on_error(const Group& group, Fn&& prepare) {
  try {
    return prepare();
  } catch (const std::exception&) {
    group.fail_together(std::current_exception());
  }
}

// Outputs of an op must not alias its inputs (the single-rank paths return them as they are)
// and are contiguous, as the fake kernels promise the compiler.
at::Tensor fresh(const at::Tensor& out, c10::ArrayRef<at::Tensor> inputs) {
  for (const at::Tensor& in : inputs)
    if (in.defined() && out.is_alias_of(in)) return out.clone(at::MemoryFormat::Contiguous);
  return out.contiguous();
}

std::vector<at::Tensor> fresh(std::vector<at::Tensor> outs, c10::ArrayRef<at::Tensor> inputs) {
  for (at::Tensor& o : outs) o = fresh(o, inputs);
  return outs;
}

at::Tensor sequence_lengths(const at::Tensor& x, int64_t dim, const std::string& group_name,
                            int64_t timeout_ms) {
  const Group group = group_of(group_name, timeout_ms);
  auto all = group.agree([&] {
    TORCH_CHECK_VALUE(x.dim() > 0,
                      "sequence_lengths: x must have a sequence dim; got a 0-D "
                      "tensor");
    const int64_t d = dim < 0 ? dim + x.dim() : dim;
    TORCH_CHECK_INDEX(d >= 0 && d < x.dim(), "sequence_lengths: dim ", dim,
                      " is out of range for shape ", x.sizes());
    return std::vector<int64_t>{x.size(d)};
  });
  std::vector<int64_t> lengths;
  for (const auto& m : all) lengths.push_back(m[0]);
  return at::tensor(lengths, at::kLong);
}

// The arguments of a scatter op, parsed alike on every rank (raising on every rank through
// fail_together_on_error).
struct ScatterCall {
  std::vector<Heads> kinds;
  std::vector<Agreed> same;
  Layout layout = Layout::kBSHD;
  SequencePartition seq;
  HeadPartition partition;
};

ScatterCall parse_scatter_call(const char* op, size_t tensors, c10::ArrayRef<std::string> heads,
                               int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                               const std::string& layout, c10::ArrayRef<std::string> same_names,
                               c10::IntArrayRef same_values, const Group& group) {
  std::vector<Heads> kinds = parse_heads(heads);
  TORCH_CHECK_VALUE(kinds.size() == tensors, op, ": ", tensors, " tensors but ", kinds.size(),
                    " head kinds");
  TORCH_CHECK_VALUE(same_names.size() == same_values.size(), op, ": ", same_names.size(),
                    " names but ", same_values.size(), " values to agree on");
  std::vector<Agreed> same;
  for (size_t i = 0; i < same_names.size(); ++i) same.push_back({same_names[i], same_values[i]});
  return {std::move(kinds), std::move(same), parse_layout(layout),
          SequencePartition::from_lengths(seq_lens.vec()),
          HeadPartition::make(q_heads, kv_heads, group.size())};
}

std::vector<at::Tensor> scatter_heads_op(at::TensorList xs, c10::ArrayRef<std::string> heads,
                                         int64_t q_heads, int64_t kv_heads,
                                         c10::IntArrayRef seq_lens, const std::string& layout,
                                         const std::string& group_name, int64_t timeout_ms,
                                         c10::ArrayRef<std::string> same_names,
                                         c10::IntArrayRef same_values) {
  const Group group = group_of(group_name, timeout_ms);
  std::vector<TensorSpec> specs;
  const ScatterCall call = fail_together_on_error(group, [&] {
    ScatterCall c = parse_scatter_call("scatter_heads", xs.size(), heads, q_heads, kv_heads,
                                       seq_lens, layout, same_names, same_values, group);
    for (size_t i = 0; i < xs.size(); ++i)
      specs.push_back({xs[i], c.kinds[i], "tensor " + std::to_string(i)});
    return c;
  });
  // Checks every rank's tensors and the given split in one small collective before data moves.
  const AllToAllPlan plan =
      agree_plan(group, call.partition, call.layout, specs, call.seq, call.same);
  at::NoGradGuard no_grad;
  return fresh(scatter_heads(xs.vec(), call.kinds, plan, group), xs);
}

// scatter_heads from head parts: `parts` holds tensor t's part for rank j at t * P + j.
std::vector<at::Tensor> scatter_head_parts_op(
    at::TensorList parts, c10::ArrayRef<std::string> heads, int64_t q_heads, int64_t kv_heads,
    c10::IntArrayRef seq_lens, const std::string& layout, const std::string& group_name,
    int64_t timeout_ms, c10::ArrayRef<std::string> same_names, c10::IntArrayRef same_values) {
  const Group group = group_of(group_name, timeout_ms);
  const auto P = static_cast<size_t>(group.size());
  std::vector<std::vector<at::Tensor>> nested;
  std::vector<TensorSpec> specs;
  const ScatterCall call = fail_together_on_error(group, [&] {
    ScatterCall c = parse_scatter_call("scatter_head_parts", parts.size() / P, heads, q_heads,
                                       kv_heads, seq_lens, layout, same_names, same_values, group);
    TORCH_CHECK_VALUE(parts.size() == c.kinds.size() * P, "scatter_head_parts: ", parts.size(),
                      " parts for ", c.kinds.size(), " tensors over ", P, " ranks");
    for (size_t t = 0; t < c.kinds.size(); ++t) {
      nested.emplace_back(parts.begin() + t * P, parts.begin() + (t + 1) * P);
      const std::string name = "tensor " + std::to_string(t);
      specs.push_back({stand_in_for_parts(nested.back(), c.kinds[t], c.partition, c.layout,
                                          "scatter_head_parts: " + name),
                       c.kinds[t], name});
    }
    return c;
  });
  const AllToAllPlan plan =
      agree_plan(group, call.partition, call.layout, specs, call.seq, call.same);
  at::NoGradGuard no_grad;
  return fresh(scatter_head_parts(nested, call.kinds, plan, group), parts);
}

// gather_heads, or with `parts` gather_head_parts (tensor t's part from rank j at t * P + j).
std::vector<at::Tensor> gather_op(at::TensorList ys, c10::ArrayRef<std::string> heads,
                                  int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                                  const std::string& layout, const std::string& group_name,
                                  int64_t timeout_ms, bool parts) {
  const Group group = group_of(group_name, timeout_ms);
  const std::vector<Heads> kinds = parse_heads(heads);
  TORCH_CHECK_VALUE(kinds.size() == ys.size(), "gather_heads: ", ys.size(), " tensors but ",
                    kinds.size(), " head kinds");
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, layout, group);
  at::NoGradGuard no_grad;
  return fresh(parts ? gather_head_parts(ys.vec(), kinds, plan, group)
                     : gather_heads(ys.vec(), kinds, plan, group),
               ys);
}

std::vector<at::Tensor> gather_heads_op(at::TensorList ys, c10::ArrayRef<std::string> heads,
                                        int64_t q_heads, int64_t kv_heads,
                                        c10::IntArrayRef seq_lens, const std::string& layout,
                                        const std::string& group_name, int64_t timeout_ms) {
  return gather_op(ys, heads, q_heads, kv_heads, seq_lens, layout, group_name, timeout_ms, false);
}

std::vector<at::Tensor> gather_head_parts_op(at::TensorList ys, c10::ArrayRef<std::string> heads,
                                             int64_t q_heads, int64_t kv_heads,
                                             c10::IntArrayRef seq_lens, const std::string& layout,
                                             const std::string& group_name, int64_t timeout_ms) {
  return gather_op(ys, heads, q_heads, kv_heads, seq_lens, layout, group_name, timeout_ms, true);
}

at::Tensor all_gather_sequence_op(const at::Tensor& x, int64_t dim, c10::IntArrayRef seq_lens,
                                  const std::string& group_name, int64_t timeout_ms) {
  const Group group = group_of(group_name, timeout_ms);
  at::NoGradGuard no_grad;
  return fresh(all_gather_sequence(x, dim, SequencePartition::from_lengths(seq_lens.vec()), group),
               {x});
}

at::Tensor reduce_scatter_sequence_op(const at::Tensor& x, int64_t dim, c10::IntArrayRef seq_lens,
                                      const std::string& group_name, int64_t timeout_ms) {
  const Group group = group_of(group_name, timeout_ms);
  at::NoGradGuard no_grad;
  return fresh(
      reduce_scatter_sequence(x, dim, SequencePartition::from_lengths(seq_lens.vec()), group), {x});
}

at::Tensor rebuild_mask_op(const at::Tensor& mask, int64_t q_heads, int64_t kv_heads,
                           c10::IntArrayRef seq_lens, const std::string& group_name,
                           int64_t timeout_ms, int64_t key_len) {
  const Group group = group_of(group_name, timeout_ms);
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, "BHSD", group);
  at::NoGradGuard no_grad;
  return fresh(as_4d_mask(rebuild_mask(mask, plan, group, "mask", key_len)), {mask});
}

at::Tensor rebuild_mask_backward_op(const at::Tensor& grad, c10::IntArrayRef mask_sizes,
                                    int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                                    const std::string& group_name, int64_t timeout_ms,
                                    int64_t key_len) {
  const Group group = group_of(group_name, timeout_ms);
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, "BHSD", group);
  at::NoGradGuard no_grad;
  return fresh(rebuild_mask_backward(grad, mask_sizes.vec(), plan, group, key_len), {grad});
}

LocalAttentionArgs local_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              c10::IntArrayRef kv_map, const c10::optional<at::Tensor>& mask,
                              const c10::optional<at::Tensor>& positions, bool causal,
                              double scale) {
  LocalAttentionArgs a;
  a.q = q, a.k = k, a.v = v;
  a.kv_map = kv_map.vec();
  a.mask = mask;
  a.positions = positions;
  a.causal = causal;
  a.scale = scale;
  return a;
}

std::tuple<at::Tensor, at::Tensor> flash_attention_op(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, c10::IntArrayRef kv_map,
                                                      const c10::optional<at::Tensor>& mask,
                                                      const c10::optional<at::Tensor>& positions,
                                                      bool causal, double scale) {
  auto [out, lse] =
      flash_attention_forward(local_args(q, k, v, kv_map, mask, positions, causal, scale));
  return {out.contiguous(), lse.contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::IntArrayRef kv_map,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& positions, bool causal,
    double scale, bool mask_grad) {
  auto g = flash_attention_backward(
      grad_out, local_args(q, k, v, kv_map, mask, positions, causal, scale), out, lse, mask_grad);
  // No mask gradient: an empty tensor (a dispatcher op cannot return an undefined one).
  if (!g[3].defined()) g[3] = at::empty({0}, q.options());
  return {g[0].contiguous(), g[1].contiguous(), g[2].contiguous(), g[3].contiguous()};
}

std::tuple<at::Tensor, at::Tensor> ring_attention_op(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, c10::IntArrayRef kv_map,
                                                     const c10::optional<at::Tensor>& mask,
                                                     const c10::optional<at::Tensor>& docs,
                                                     bool causal, double scale, int64_t seq_len,
                                                     int64_t ulysses, const std::string& ring_group,
                                                     int64_t timeout_ms) {
  const Group ring = group_of(ring_group, timeout_ms);
  const RingLayout layout = RingLayout::make(seq_len, ulysses, ring.size());
  auto [out, lse] = ring_attention_forward(local_args(q, k, v, kv_map, mask, {}, causal, scale),
                                           layout, docs.value_or(at::Tensor()), ring);
  return {out.contiguous(), lse.contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ring_attention_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::IntArrayRef kv_map,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& docs, bool causal,
    double scale, int64_t seq_len, int64_t ulysses, const std::string& ring_group,
    int64_t timeout_ms, bool mask_grad) {
  const Group ring = group_of(ring_group, timeout_ms);
  const RingLayout layout = RingLayout::make(seq_len, ulysses, ring.size());
  auto g = ring_attention_backward(grad_out, local_args(q, k, v, kv_map, mask, {}, causal, scale),
                                   layout, docs.value_or(at::Tensor()), ring, out, lse, mask_grad);
  // No mask gradient: an empty tensor (a dispatcher op cannot return an undefined one).
  if (!g[3].defined()) g[3] = at::empty({0}, q.options());
  return {g[0].contiguous(), g[1].contiguous(), g[2].contiguous(), g[3].contiguous()};
}

at::Tensor ring_document_ids_op(const at::Tensor& positions, int64_t seq_len, int64_t ulysses,
                                const std::string& ring_group, int64_t timeout_ms) {
  const Group ring = group_of(ring_group, timeout_ms);
  return ring_document_ids(positions, RingLayout::make(seq_len, ulysses, ring.size()), ring);
}

}  // namespace

TORCH_LIBRARY(ulysses, m) {
  m.def("sequence_lengths(Tensor x, int dim, str group, int timeout_ms) -> Tensor");
  // same_names/same_values: values of the call every rank must hold alike (mask given, its
  // dtype, causal...), agreed in the same round as the tensors.
  m.def(
      "scatter_heads(Tensor[] xs, str[] heads, int q_heads, int kv_heads, int[] seq_lens, "
      "str layout, str group, int timeout_ms, str[] same_names, int[] same_values) -> "
      "Tensor[]");
  m.def(
      "gather_heads(Tensor[] ys, str[] heads, int q_heads, int kv_heads, int[] seq_lens, "
      "str layout, str group, int timeout_ms) -> Tensor[]");
  // Head parts (all_to_all.h): tensor t's part for (or from) rank j at t * P + j.
  m.def(
      "scatter_head_parts(Tensor[] parts, str[] heads, int q_heads, int kv_heads, "
      "int[] seq_lens, str layout, str group, int timeout_ms, str[] same_names, "
      "int[] same_values) -> Tensor[]");
  m.def(
      "gather_head_parts(Tensor[] ys, str[] heads, int q_heads, int kv_heads, int[] seq_lens, "
      "str layout, str group, int timeout_ms) -> Tensor[]");
  m.def(
      "all_gather_sequence(Tensor x, int dim, int[] seq_lens, str group, int timeout_ms) -> "
      "Tensor");
  m.def(
      "reduce_scatter_sequence(Tensor x, int dim, int[] seq_lens, str group, int timeout_ms) "
      "-> Tensor");
  m.def(
      "rebuild_mask(Tensor mask, int q_heads, int kv_heads, int[] seq_lens, str group, "
      "int timeout_ms, int key_len=-1) -> Tensor");
  m.def(
      "rebuild_mask_backward(Tensor grad, int[] mask_sizes, int q_heads, int kv_heads, "
      "int[] seq_lens, str group, int timeout_ms, int key_len=-1) -> Tensor");
  m.def(
      "flash_attention(Tensor q, Tensor k, Tensor v, int[] kv_map, Tensor? mask, "
      "Tensor? positions, bool causal, float scale) -> (Tensor, Tensor)");
  m.def(
      "flash_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, int[] kv_map, Tensor? mask, Tensor? positions, bool causal, float scale, "
      "bool mask_grad) -> (Tensor, Tensor, Tensor, Tensor)");
  // Ring attention over `ring_group` for this ring rank's tokens of RingLayout(seq_len,
  // ulysses, ring size); docs: [B or 1, seq_len] global document ids.
  m.def(
      "ring_attention(Tensor q, Tensor k, Tensor v, int[] kv_map, Tensor? mask, Tensor? docs, "
      "bool causal, float scale, int seq_len, int ulysses, str ring_group, int timeout_ms) -> "
      "(Tensor, Tensor)");
  m.def(
      "ring_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, int[] kv_map, Tensor? mask, Tensor? docs, bool causal, float scale, "
      "int seq_len, int ulysses, str ring_group, int timeout_ms, bool mask_grad) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ring_document_ids(Tensor positions, int seq_len, int ulysses, str ring_group, "
      "int timeout_ms) -> Tensor");
}

// Collectives: one kernel for every device (the ProcessGroup dispatches by device).
TORCH_LIBRARY_IMPL(ulysses, CompositeExplicitAutograd, m) {
  m.impl("sequence_lengths", &sequence_lengths);
  m.impl("scatter_heads", &scatter_heads_op);
  m.impl("gather_heads", &gather_heads_op);
  m.impl("scatter_head_parts", &scatter_head_parts_op);
  m.impl("gather_head_parts", &gather_head_parts_op);
  m.impl("all_gather_sequence", &all_gather_sequence_op);
  m.impl("reduce_scatter_sequence", &reduce_scatter_sequence_op);
  m.impl("rebuild_mask", &rebuild_mask_op);
  m.impl("rebuild_mask_backward", &rebuild_mask_backward_op);
  m.impl("ring_document_ids", &ring_document_ids_op);
}

// The fused kernel is CPU code (CUDA tensors use SDPA in python/ulysses/attention.py).
TORCH_LIBRARY_IMPL(ulysses, CPU, m) {
  m.impl("flash_attention", &flash_attention_op);
  m.impl("flash_attention_backward", &flash_attention_backward_op);
  m.impl("ring_attention", &ring_attention_op);
  m.impl("ring_attention_backward", &ring_attention_backward_op);
}

}  // namespace ulysses
