// torch.ops.ulysses, the transport floor: exchanges between sequence and head sharding
// (whole tensors, head parts, projected), sequence collectives and sums over a group.
// Every ops file's conventions: Note [Op files] in transport/ops.h.
#include "transport/ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "dispatch/autograd.h"
#include "dispatch/op_util.h"
#include "transport/head_parts.h"
#include "transport/op_options.h"
#include "ulysses/all_to_all.h"
#include "ulysses/group.h"
#include "ulysses/partition.h"

namespace ulysses {
namespace {

using namespace detail;  // NOLINT: this floor's op helpers and kernels.

// The names of the exchanged tensors in messages: q, k, v for an attention call's.
std::vector<std::string> tensor_names(const std::vector<Heads>& tensor_heads) {
  if (tensor_heads.size() == 3 && tensor_heads[0] == Heads::kQuery &&
      tensor_heads[1] == Heads::kKeyValue && tensor_heads[2] == Heads::kKeyValue) {
    return {"q", "k", "v"};
  }
  std::vector<std::string> names;
  for (size_t t = 0; t < tensor_heads.size(); ++t) names.push_back("tensor " + std::to_string(t));
  return names;
}

CallOptions call_options(const std::vector<std::string>& names, const OptTensor& mask,
                         const OptTensor& positions, bool causal, double scale, bool step,
                         bool check_mask, int64_t window, double softcap, const OptTensor& sinks) {
  CallOptions o;
  o.rules() = op_rules(causal, scale, window, softcap);
  o.mask_check = check_mask ? CallOptions::MaskCheck::kAgreement : CallOptions::MaskCheck::kCaller;
  o.attention = names.size() == 3 && names[0] == "q";
  o.mask = mask;
  o.positions = positions;
  o.sinks = sinks;
  o.step_context = step;
  // The whole-tensor exchange of q, k, v is the call later calls with a StepContext reuse (the
  // caller arms the group; Note [Reused agreement]).
  o.reuses_agreement = step && o.attention;
  return o;
}

// ---- sequence_lengths ----------------------------------------------------------------------

at::Tensor sequence_lengths_op(const at::Tensor& x, int64_t dim, const std::string& group_name,
                               c10::IntArrayRef group_options) {
  const Group group = group_of_op(group_name, group_options);
  auto all = group.agree(
      [&] {
        TORCH_CHECK_VALUE(x.dim() > 0,
                          "sequence_lengths: x must have a sequence dim; got a 0-D "
                          "tensor");
        const int64_t d = dim < 0 ? dim + x.dim() : dim;
        TORCH_CHECK_INDEX(d >= 0 && d < x.dim(), "sequence_lengths: dim ", dim,
                          " is out of range for shape ", x.sizes());
        return std::vector<int64_t>{x.size(d)};
      },
      "every rank's token count (sequence_lengths)");
  std::vector<int64_t> lengths;
  for (const auto& m : all) lengths.push_back(m[0]);
  return at::tensor(lengths, at::kLong);
}

// ---- scatter_heads / gather_heads ----------------------------------------------------------

std::vector<at::Tensor> scatter_heads_op(at::TensorList xs, Strings heads, int64_t q_heads,
                                         int64_t kv_heads, c10::IntArrayRef seq_lens,
                                         const std::string& layout, const std::string& group_name,
                                         c10::IntArrayRef group_options, bool agree,
                                         const OptTensor& mask, const OptTensor& positions,
                                         bool causal, double scale, bool step, bool check_mask,
                                         int64_t window, double softcap, const OptTensor& sinks) {
  const Group group = group_of_op(group_name, group_options);
  if (!agree) {  // The library's own call (a backward, or the C++ API after agree_plan).
    const std::vector<Heads> tensor_heads = parse_heads(heads);
    const Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, layout, group.size());
    return unaliased(detail::scatter_heads_kernel(xs.vec(), tensor_heads, sharding, group), xs);
  }
  std::vector<TensorSpec> specs;
  std::vector<Heads> tensor_heads;
  const Sharding given = fail_together_on_error(group, [&] {
    tensor_heads = parse_heads(heads);
    TORCH_CHECK_VALUE(tensor_heads.size() == xs.size(), "scatter_heads: ", xs.size(),
                      " tensors but ", tensor_heads.size(), " head tensor_heads");
    const std::vector<std::string> names = tensor_names(tensor_heads);
    for (size_t i = 0; i < xs.size(); ++i) specs.push_back({xs[i], tensor_heads[i], names[i]});
    check_4d(specs, parse_layout(layout));  // Before the head counts read from them.
    return sharding_of(q_heads, kv_heads, seq_lens, layout, group.size());
  });
  // Checks every rank's tensors and the given split in one small collective before data moves.
  const Sharding sharding =
      agree_plan(group, given.heads, given.layout, specs, given.seq,
                 call_options(tensor_names(tensor_heads), mask, positions, causal, scale, step,
                              check_mask, window, softcap, sinks));
  return unaliased(detail::scatter_heads_kernel(xs.vec(), tensor_heads, sharding, group), xs);
}

std::vector<at::Tensor> scatter_heads_autograd(
    at::TensorList xs, Strings heads, int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
    const std::string& layout, const std::string& group_name, c10::IntArrayRef group_options,
    bool agree, const OptTensor& mask, const OptTensor& positions, bool causal, double scale,
    bool step, bool check_mask, int64_t window, double softcap, const OptTensor& sinks) {
  static const auto op = op_handle<decltype(scatter_heads_op)>("ulysses::scatter_heads");
  std::vector<at::Tensor> outs = below_autograd([&] {
    return op.call(xs, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options, agree,
                   mask, positions, causal, scale, step, check_mask, window, softcap, sinks);
  });
  if (!needs_grad(xs)) return outs;
  // The kernel checked the arguments on every rank: parsing them again cannot fail.
  const Group group = group_of_op(group_name, group_options);
  const Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, layout, group.size());
  detail::attach_backward(
      xs.vec(), outs, "ScatterHeadsBackward",
      [tensor_heads = parse_heads(heads), sharding, group](std::vector<at::Tensor>&& g) {
        return gather_heads(g, tensor_heads, sharding, group);
      });
  return outs;
}

// scatter_heads from head parts: `parts` holds tensor t's part for rank j at t * P + j.
std::vector<at::Tensor> scatter_head_parts_op(
    at::TensorList parts, Strings heads, int64_t q_heads, int64_t kv_heads,
    c10::IntArrayRef seq_lens, const std::string& layout, const std::string& group_name,
    c10::IntArrayRef group_options, bool agree, const OptTensor& mask, const OptTensor& positions,
    bool causal, double scale, bool step, bool check_mask, int64_t window, double softcap,
    const OptTensor& sinks) {
  const Group group = group_of_op(group_name, group_options);
  const auto P = static_cast<size_t>(group.size());
  std::vector<std::vector<at::Tensor>> nested;
  std::vector<TensorSpec> specs;
  std::vector<Heads> tensor_heads;
  auto parse = [&] {
    tensor_heads = parse_heads(heads);
    const Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, layout, group.size());
    TORCH_CHECK_VALUE(parts.size() == tensor_heads.size() * P, "scatter_head_parts: ", parts.size(),
                      " parts for ", tensor_heads.size(), " tensors over ", P, " ranks");
    const std::vector<std::string> names = tensor_names(tensor_heads);
    for (size_t t = 0; t < tensor_heads.size(); ++t) {
      nested.emplace_back(parts.begin() + t * P, parts.begin() + (t + 1) * P);
      if (agree) {
        specs.push_back({stand_in_for_parts(nested.back(), tensor_heads[t], sharding.heads,
                                            sharding.layout, "scatter_head_parts: " + names[t]),
                         tensor_heads[t], names[t]});
      }
    }
    return sharding;
  };
  if (!agree) {
    return unaliased(detail::scatter_head_parts_kernel(nested, tensor_heads, parse(), group),
                     parts);
  }
  const Sharding given = fail_together_on_error(group, parse);
  CallOptions options = call_options(tensor_names(tensor_heads), mask, positions, causal, scale,
                                     step, check_mask, window, softcap, sinks);
  options.reuses_agreement = false;  // Head parts: a step never reuses their agreement.
  const Sharding sharding = agree_plan(group, given.heads, given.layout, specs, given.seq, options);
  return unaliased(detail::scatter_head_parts_kernel(nested, tensor_heads, sharding, group), parts);
}

std::vector<at::Tensor> scatter_head_parts_autograd(
    at::TensorList parts, Strings heads, int64_t q_heads, int64_t kv_heads,
    c10::IntArrayRef seq_lens, const std::string& layout, const std::string& group_name,
    c10::IntArrayRef group_options, bool agree, const OptTensor& mask, const OptTensor& positions,
    bool causal, double scale, bool step, bool check_mask, int64_t window, double softcap,
    const OptTensor& sinks) {
  static const auto op = op_handle<decltype(scatter_head_parts_op)>("ulysses::scatter_head_parts");
  std::vector<at::Tensor> outs = below_autograd([&] {
    return op.call(parts, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options,
                   agree, mask, positions, causal, scale, step, check_mask, window, softcap, sinks);
  });
  if (!needs_grad(parts)) return outs;
  const Group group = group_of_op(group_name, group_options);
  const Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, layout, group.size());
  detail::attach_backward(
      parts.vec(), outs, "ScatterHeadPartsBackward",
      [tensor_heads = parse_heads(heads), sharding, group](std::vector<at::Tensor>&& g) {
        return gather_head_parts(g, tensor_heads, sharding, group);
      });
  return outs;
}

// gather_heads, or gather_head_parts (tensor t's part from rank j at t * P + j).
std::vector<at::Tensor> gather_kernel(at::TensorList ys, Strings heads, int64_t q_heads,
                                      int64_t kv_heads, c10::IntArrayRef seq_lens,
                                      const std::string& layout, const std::string& group_name,
                                      c10::IntArrayRef group_options, HeadForm form) {
  const Group group = group_of_op(group_name, group_options);
  const std::vector<Heads> tensor_heads = parse_heads(heads);
  TORCH_CHECK_VALUE(tensor_heads.size() == ys.size(), "gather_heads: ", ys.size(), " tensors but ",
                    tensor_heads.size(), " head tensor_heads");
  const Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, layout, group.size());
  return unaliased(detail::gather_heads_kernel(ys.vec(), tensor_heads, sharding, group, form), ys);
}

std::vector<at::Tensor> gather_heads_op(at::TensorList ys, Strings heads, int64_t q_heads,
                                        int64_t kv_heads, c10::IntArrayRef seq_lens,
                                        const std::string& layout, const std::string& group_name,
                                        c10::IntArrayRef group_options) {
  return gather_kernel(ys, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options,
                       HeadForm::kWhole);
}

std::vector<at::Tensor> gather_head_parts_op(at::TensorList ys, Strings heads, int64_t q_heads,
                                             int64_t kv_heads, c10::IntArrayRef seq_lens,
                                             const std::string& layout,
                                             const std::string& group_name,
                                             c10::IntArrayRef group_options) {
  return gather_kernel(ys, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options,
                       HeadForm::kParts);
}

// The autograd of gather_heads and gather_head_parts.
template <HeadForm form>
std::vector<at::Tensor> gather_autograd(at::TensorList ys, Strings heads, int64_t q_heads,
                                        int64_t kv_heads, c10::IntArrayRef seq_lens,
                                        const std::string& layout, const std::string& group_name,
                                        c10::IntArrayRef group_options) {
  constexpr bool parts = form == HeadForm::kParts;
  static const auto op = op_handle<decltype(gather_heads_op)>(parts ? "ulysses::gather_head_parts"
                                                                    : "ulysses::gather_heads");
  std::vector<at::Tensor> outs = below_autograd([&] {
    return op.call(ys, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options);
  });
  if (!needs_grad(ys)) return outs;
  const Group group = group_of_op(group_name, group_options);
  const Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, layout, group.size());
  detail::attach_backward(
      ys.vec(), outs, parts ? "GatherHeadPartsBackward" : "GatherHeadsBackward",
      [tensor_heads = parse_heads(heads), sharding, group](std::vector<at::Tensor>&& g) {
        if (!parts) return scatter_heads(g, tensor_heads, sharding, group);
        const auto P = static_cast<size_t>(group.size());
        std::vector<std::vector<at::Tensor>> nested;
        for (size_t t = 0; t < tensor_heads.size(); ++t)
          nested.emplace_back(g.begin() + t * P, g.begin() + (t + 1) * P);
        return scatter_head_parts(nested, tensor_heads, sharding, group);
      });
  return outs;
}

// ---- all_gather_sequence / reduce_scatter_sequence ----------------------------------------

ShapeAgreement shapes_of(bool agree) {
  return agree ? ShapeAgreement::kAgree : ShapeAgreement::kAgreed;
}

constexpr const char* op_name(SequenceCollective which) {
  return which == SequenceCollective::kAllGather ? "ulysses::all_gather_sequence"
                                                 : "ulysses::reduce_scatter_sequence";
}

template <SequenceCollective which>
at::Tensor sequence_op(const at::Tensor& x, int64_t dim, c10::IntArrayRef seq_lens,
                       const std::string& group_name, c10::IntArrayRef group_options, bool agree) {
  const Group group = group_of_op(group_name, group_options);
  const auto seq = SequencePartition::from_lengths(seq_lens.vec());
  return unaliased(detail::sequence_collective_kernel(x, dim, seq, group, which, shapes_of(agree)),
                   {x});
}

// The adjoint of each sequence collective.
constexpr SequenceCollective adjoint(SequenceCollective which) {
  return which == SequenceCollective::kAllGather ? SequenceCollective::kReduceScatter
                                                 : SequenceCollective::kAllGather;
}

template <SequenceCollective which>
at::Tensor sequence_autograd(const at::Tensor& x, int64_t dim, c10::IntArrayRef seq_lens,
                             const std::string& group_name, c10::IntArrayRef group_options,
                             bool agree) {
  static const auto op = op_handle<decltype(sequence_op<which>)>(op_name(which));
  std::vector<at::Tensor> outs{
      below_autograd([&] { return op.call(x, dim, seq_lens, group_name, group_options, agree); })};
  if (!needs_grad({x})) return outs[0];
  const Group group = group_of_op(group_name, group_options);
  const auto seq = SequencePartition::from_lengths(seq_lens.vec());
  detail::attach_backward(
      {x}, outs,
      which == SequenceCollective::kReduceScatter ? "ReduceScatterSequenceBackward"
                                                  : "AllGatherSequenceBackward",
      [dim, seq, group](std::vector<at::Tensor>&& g) {  // Shapes agreed in the forward.
        return std::vector<at::Tensor>{detail::call_sequence_collective(
            g[0], dim, seq, group, adjoint(which), ShapeAgreement::kAgreed)};
      });
  return outs[0];
}

// ---- sum_over_group ------------------------------------------------------------------------

at::Tensor sum_over_group_op(const at::Tensor& x, const std::string& group_name,
                             c10::IntArrayRef group_options) {
  const Group group = group_of_op(group_name, group_options);
  at::Tensor out = x.contiguous().clone();
  group.all_reduce_sum(out);
  return out;
}

// Each rank backpropagates its own part of a sum over the group: the gradient passes through
// unchanged, and summing parameter gradients over the group afterwards gives the exact total.
at::Tensor sum_over_group_autograd(const at::Tensor& x, const std::string& group_name,
                                   c10::IntArrayRef group_options) {
  static const auto op = op_handle<decltype(sum_over_group_op)>("ulysses::sum_over_group");
  std::vector<at::Tensor> outs{
      below_autograd([&] { return op.call(x, group_name, group_options); })};
  if (!needs_grad({x})) return outs[0];
  detail::attach_backward({x}, outs, "SumOverGroupBackward",
                          [](std::vector<at::Tensor>&& g) { return std::move(g); });
  return outs[0];
}

}  // namespace

// ---- the library's calls into these ops ----------------------------------------------------

namespace detail {

Sharding sharding_of(int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                     const std::string& layout, int64_t sp_size) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(seq_lens.size()) == sp_size,
                    "ulysses: seq_lens must have one entry per rank (", sp_size, "); got ",
                    seq_lens.size());
  return Sharding{HeadPartition::make(q_heads, kv_heads, sp_size),
                  SequencePartition::from_lengths(seq_lens.vec()), parse_layout(layout)};
}

std::vector<at::Tensor> call_scatter_heads(const std::vector<at::Tensor>& xs,
                                           const std::vector<Heads>& tensor_heads,
                                           const Sharding& sharding, const Group& group) {
  static const auto op = op_handle<decltype(scatter_heads_op)>("ulysses::scatter_heads");
  return op.call(xs, heads_args(tensor_heads), sharding.heads.q_heads(), sharding.heads.kv_heads(),
                 sharding.seq.lengths(), to_string(sharding.layout), op_group_name(group),
                 options_to_ints(group.options()), /*agree=*/false, {}, {}, false, 0.0, false, true,
                 0, 0.0, {});
}

std::vector<at::Tensor> call_scatter_head_parts(const std::vector<std::vector<at::Tensor>>& parts,
                                                const std::vector<Heads>& tensor_heads,
                                                const Sharding& sharding, const Group& group) {
  static const auto op = op_handle<decltype(scatter_head_parts_op)>("ulysses::scatter_head_parts");
  std::vector<at::Tensor> flat;
  for (const auto& p : parts) flat.insert(flat.end(), p.begin(), p.end());
  return op.call(flat, heads_args(tensor_heads), sharding.heads.q_heads(),
                 sharding.heads.kv_heads(), sharding.seq.lengths(), to_string(sharding.layout),
                 op_group_name(group), options_to_ints(group.options()), /*agree=*/false, {}, {},
                 false, 0.0, false, true, 0, 0.0, {});
}

std::vector<at::Tensor> call_scatter_agreed(const std::vector<std::vector<at::Tensor>>& qkv,
                                            HeadForm form, const std::vector<Heads>& tensor_heads,
                                            int64_t q_heads, int64_t kv_heads,
                                            const SequencePartition& seq, Layout layout,
                                            const Group& group, const CallOptions& options) {
  static const auto whole = op_handle<decltype(scatter_heads_op)>("ulysses::scatter_heads");
  static const auto by_part =
      op_handle<decltype(scatter_head_parts_op)>("ulysses::scatter_head_parts");
  std::vector<at::Tensor> flat;
  for (const auto& t : qkv) flat.insert(flat.end(), t.begin(), t.end());
  return (form == HeadForm::kParts ? by_part : whole)
      .call(flat, heads_args(tensor_heads), q_heads, kv_heads, seq.lengths(), to_string(layout),
            op_group_name(group), options_to_ints(group.options()), /*agree=*/true, options.mask,
            options.positions, options.causal, options.scale, options.step_context,
            options.mask_check == CallOptions::MaskCheck::kAgreement, options.window,
            options.softcap, options.sinks);
}

std::vector<at::Tensor> call_gather_heads(const std::vector<at::Tensor>& ys,
                                          const std::vector<Heads>& tensor_heads,
                                          const Sharding& sharding, const Group& group,
                                          HeadForm form) {
  static const auto gather = op_handle<decltype(gather_heads_op)>("ulysses::gather_heads");
  static const auto gather_parts =
      op_handle<decltype(gather_heads_op)>("ulysses::gather_head_parts");
  return (form == HeadForm::kParts ? gather_parts : gather)
      .call(ys, heads_args(tensor_heads), sharding.heads.q_heads(), sharding.heads.kv_heads(),
            sharding.seq.lengths(), to_string(sharding.layout), op_group_name(group),
            options_to_ints(group.options()));
}

at::Tensor call_sequence_collective(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                    const Group& group, SequenceCollective which,
                                    ShapeAgreement shapes) {
  using Op = decltype(sequence_op<SequenceCollective::kAllGather>);
  static const auto gather = op_handle<Op>(op_name(SequenceCollective::kAllGather));
  static const auto scatter = op_handle<Op>(op_name(SequenceCollective::kReduceScatter));
  return (which == SequenceCollective::kAllGather ? gather : scatter)
      .call(x, dim, seq.lengths(), op_group_name(group), options_to_ints(group.options()),
            shapes == ShapeAgreement::kAgree);
}

}  // namespace detail

TORCH_LIBRARY_FRAGMENT(ulysses, m) {
  // `group`: a torch.distributed group name ("" for this rank alone); `group_options`:
  // [timeout ms (-1: the group's own), pipeline_min_bytes, message_bytes, shared_memory,
  // transport], a shorter list leaving defaults (transport/op_options.h).
  const std::vector<at::Tag> pt2{at::Tag::pt2_compliant_tag};
  m.def("sequence_lengths(Tensor x, int dim, str group, int[] group_options) -> Tensor", pt2);
  // agree: check every rank's call first (the call fingerprint: tensors, head counts, the
  // split, and an attention call's mask, position ids, causal, scale and StepContext use).
  m.def(
      "scatter_heads(Tensor[] xs, str[] heads, int q_heads, int kv_heads, int[] seq_lens, "
      "str layout, str group, int[] group_options, bool agree=True, Tensor? mask=None, "
      "Tensor? positions=None, bool causal=False, float scale=0., bool step=False, "
      "bool check_mask=True, int window=0, float softcap=0., Tensor? sinks=None) -> Tensor[]",
      pt2);
  m.def(
      "gather_heads(Tensor[] ys, str[] heads, int q_heads, int kv_heads, int[] seq_lens, "
      "str layout, str group, int[] group_options) -> Tensor[]",
      pt2);
  // Head parts (all_to_all.h): tensor t's part for (or from) rank j at t * P + j.
  m.def(
      "scatter_head_parts(Tensor[] parts, str[] heads, int q_heads, int kv_heads, "
      "int[] seq_lens, str layout, str group, int[] group_options, bool agree=True, "
      "Tensor? mask=None, Tensor? positions=None, bool causal=False, float scale=0., "
      "bool step=False, bool check_mask=True, int window=0, float softcap=0., Tensor? sinks=None) "
      "-> Tensor[]",
      pt2);
  m.def(
      "gather_head_parts(Tensor[] ys, str[] heads, int q_heads, int kv_heads, int[] seq_lens, "
      "str layout, str group, int[] group_options) -> Tensor[]",
      pt2);
  // agree=False: the shapes are known alike on every rank (the backward of the other one).
  m.def(
      "all_gather_sequence(Tensor x, int dim, int[] seq_lens, str group, int[] group_options, "
      "bool agree=True) -> Tensor",
      pt2);
  m.def(
      "reduce_scatter_sequence(Tensor x, int dim, int[] seq_lens, str group, "
      "int[] group_options, bool agree=True) -> Tensor",
      pt2);
  m.def("sum_over_group(Tensor x, str group, int[] group_options) -> Tensor", pt2);
}

// Collectives: one kernel for every device (the ProcessGroup dispatches by device).
TORCH_LIBRARY_IMPL(ulysses, CompositeExplicitAutograd, m) {
  m.impl("sequence_lengths", &sequence_lengths_op);
  m.impl("scatter_heads", &scatter_heads_op);
  m.impl("gather_heads", &gather_heads_op);
  m.impl("scatter_head_parts", &scatter_head_parts_op);
  m.impl("gather_head_parts", &gather_head_parts_op);
  m.impl("all_gather_sequence", &sequence_op<SequenceCollective::kAllGather>);
  m.impl("reduce_scatter_sequence", &sequence_op<SequenceCollective::kReduceScatter>);
  m.impl("sum_over_group", &sum_over_group_op);
}

TORCH_LIBRARY_IMPL(ulysses, Autograd, m) {
  m.impl("scatter_heads", &scatter_heads_autograd);
  m.impl("gather_heads", &gather_autograd<HeadForm::kWhole>);
  m.impl("scatter_head_parts", &scatter_head_parts_autograd);
  m.impl("gather_head_parts", &gather_autograd<HeadForm::kParts>);
  m.impl("all_gather_sequence", &sequence_autograd<SequenceCollective::kAllGather>);
  m.impl("reduce_scatter_sequence", &sequence_autograd<SequenceCollective::kReduceScatter>);
  m.impl("sum_over_group", &sum_over_group_autograd);
}

}  // namespace ulysses
