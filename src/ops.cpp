// torch.ops.ulysses: the library's operations registered with PyTorch's dispatcher, with their
// autograd (Note [One autograd] in detail/ops.h).
//
// Each op takes its process group as the torch.distributed group name (a string, as torch's
// functional collectives do) and the group handle's options as integers, so torch.compile can
// trace calls to it. Kernels run without autograd and return outputs that never alias their
// inputs (a dispatcher op contract); the autograd kernels run the kernel below autograd and
// record the adjoint op as the backward. Fake kernels live in python/ulysses/ops.py.
#include "detail/ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "detail/autograd.h"
#include "detail/kernel_ops.h"
#include "ulysses/distributed_attention.h"
#include "ulysses/flash_attention.h"
#include "ulysses/group.h"
#include "ulysses/mask.h"
#include "ulysses/partition.h"
#include "ulysses/ring_attention.h"
#include "ulysses/sharding.h"

namespace ulysses {
namespace {

// torch.classes.ulysses.StepContext: a StepContext made on its first use, for that call's group.
struct StepContextHolder : torch::CustomClassHolder {
  StepContext& context_for(const Group& group) {
    if (!context) context.emplace(group);
    return *context;
  }
  int64_t reuses() const { return context ? context->reuses() : 0; }
  c10::optional<StepContext> context;
};

using Strings = c10::ArrayRef<std::string>;
using OptTensor = c10::optional<at::Tensor>;
using StepHandle = c10::optional<c10::intrusive_ptr<StepContextHolder>>;

std::vector<Heads> parse_heads(Strings names) {
  std::vector<Heads> kinds;
  for (const std::string& n : names) {
    TORCH_CHECK_VALUE(n == "q" || n == "kv", "ulysses: head kind must be 'q' or 'kv'; got '", n,
                      "'");
    kinds.push_back(n == "q" ? Heads::kQuery : Heads::kKeyValue);
  }
  return kinds;
}

std::vector<std::string> heads_names(const std::vector<Heads>& kinds) {
  std::vector<std::string> names;
  for (Heads h : kinds) names.push_back(h == Heads::kQuery ? "q" : "kv");
  return names;
}

AllToAllPlan plan_of(int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                     const std::string& layout, int64_t sp_size) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(seq_lens.size()) == sp_size,
                    "ulysses: seq_lens must have one entry per rank (", sp_size, "); got ",
                    seq_lens.size());
  return AllToAllPlan{HeadPartition::make(q_heads, kv_heads, sp_size),
                      SequencePartition::from_lengths(seq_lens.vec()), parse_layout(layout)};
}

// Outputs of an op must not alias its inputs (the single-rank paths return them as they are)
// and are contiguous, as the fake kernels promise the compiler.
at::Tensor unaliased(const at::Tensor& out, c10::ArrayRef<at::Tensor> inputs) {
  for (const at::Tensor& in : inputs)
    if (in.defined() && out.is_alias_of(in)) return out.clone(at::MemoryFormat::Contiguous);
  return out.contiguous();
}

std::vector<at::Tensor> unaliased(std::vector<at::Tensor> outs, c10::ArrayRef<at::Tensor> inputs) {
  for (at::Tensor& o : outs) o = unaliased(o, inputs);
  return outs;
}

// Runs `kernel` below autograd (the op's own kernel, or its fake kernel under a compiler).
template <typename Fn>
auto below_autograd(Fn&& kernel) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return kernel();
}

bool needs_grad(c10::ArrayRef<at::Tensor> inputs) {
  return torch::autograd::compute_requires_grad(inputs);
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The names of the exchanged tensors in messages: q, k, v for an attention call's.
std::vector<std::string> tensor_names(const std::vector<Heads>& kinds) {
  if (kinds.size() == 3 && kinds[0] == Heads::kQuery && kinds[1] == Heads::kKeyValue &&
      kinds[2] == Heads::kKeyValue) {
    return {"q", "k", "v"};
  }
  std::vector<std::string> names;
  for (size_t t = 0; t < kinds.size(); ++t) names.push_back("tensor " + std::to_string(t));
  return names;
}

CallOptions call_options(const std::vector<std::string>& names, const OptTensor& mask,
                         const OptTensor& positions, bool causal, double scale, bool step,
                         bool check_mask, int64_t window, double softcap, const OptTensor& sinks) {
  CallOptions o;
  o.check_mask = check_mask;
  o.attention = names.size() == 3 && names[0] == "q";
  o.mask = mask;
  o.positions = positions;
  o.causal = causal;
  o.scale = scale;
  o.window = window;
  o.softcap = softcap;
  o.sinks = sinks;
  o.step_context = step;
  return o;
}

// ---- sequence_lengths ----------------------------------------------------------------------

at::Tensor sequence_lengths_op(const at::Tensor& x, int64_t dim, const std::string& group_name,
                               c10::IntArrayRef group_options) {
  const Group group = Group::from_op(group_name, group_options);
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
  const Group group = Group::from_op(group_name, group_options);
  if (!agree) {  // The library's own call (a backward, or the C++ API after agree_plan).
    const std::vector<Heads> kinds = parse_heads(heads);
    const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, layout, group.size());
    return unaliased(detail::scatter_heads_kernel(xs.vec(), kinds, plan, group), xs);
  }
  std::vector<TensorSpec> specs;
  std::vector<Heads> kinds;
  const AllToAllPlan given = fail_together_on_error(group, [&] {
    kinds = parse_heads(heads);
    TORCH_CHECK_VALUE(kinds.size() == xs.size(), "scatter_heads: ", xs.size(), " tensors but ",
                      kinds.size(), " head kinds");
    const std::vector<std::string> names = tensor_names(kinds);
    for (size_t i = 0; i < xs.size(); ++i) specs.push_back({xs[i], kinds[i], names[i]});
    check_4d(specs, parse_layout(layout));  // Before the head counts read from them.
    return plan_of(q_heads, kv_heads, seq_lens, layout, group.size());
  });
  // Checks every rank's tensors and the given split in one small collective before data moves.
  const AllToAllPlan plan =
      agree_plan(group, given.heads, given.layout, specs, given.seq,
                 call_options(tensor_names(kinds), mask, positions, causal, scale, step, check_mask,
                              window, softcap, sinks));
  return unaliased(detail::scatter_heads_kernel(xs.vec(), kinds, plan, group), xs);
}

std::vector<at::Tensor> scatter_heads_autograd(
    at::TensorList xs, Strings heads, int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
    const std::string& layout, const std::string& group_name, c10::IntArrayRef group_options,
    bool agree, const OptTensor& mask, const OptTensor& positions, bool causal, double scale,
    bool step, bool check_mask, int64_t window, double softcap, const OptTensor& sinks) {
  static const auto op = handle<decltype(scatter_heads_op)>("ulysses::scatter_heads");
  std::vector<at::Tensor> outs = below_autograd([&] {
    return op.call(xs, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options, agree,
                   mask, positions, causal, scale, step, check_mask, window, softcap, sinks);
  });
  if (!needs_grad(xs)) return outs;
  // The kernel checked the arguments on every rank: parsing them again cannot fail.
  const Group group = Group::from_op(group_name, group_options);
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, layout, group.size());
  detail::attach_backward(xs.vec(), outs, "ScatterHeadsBackward",
                          [kinds = parse_heads(heads), plan, group](std::vector<at::Tensor>&& g) {
                            return gather_heads(g, kinds, plan, group);
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
  const Group group = Group::from_op(group_name, group_options);
  const auto P = static_cast<size_t>(group.size());
  std::vector<std::vector<at::Tensor>> nested;
  std::vector<TensorSpec> specs;
  std::vector<Heads> kinds;
  auto parse = [&] {
    kinds = parse_heads(heads);
    const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, layout, group.size());
    TORCH_CHECK_VALUE(parts.size() == kinds.size() * P, "scatter_head_parts: ", parts.size(),
                      " parts for ", kinds.size(), " tensors over ", P, " ranks");
    const std::vector<std::string> names = tensor_names(kinds);
    for (size_t t = 0; t < kinds.size(); ++t) {
      nested.emplace_back(parts.begin() + t * P, parts.begin() + (t + 1) * P);
      if (agree) {
        specs.push_back({stand_in_for_parts(nested.back(), kinds[t], plan.heads, plan.layout,
                                            "scatter_head_parts: " + names[t]),
                         kinds[t], names[t]});
      }
    }
    return plan;
  };
  if (!agree) {
    return unaliased(detail::scatter_head_parts_kernel(nested, kinds, parse(), group), parts);
  }
  const AllToAllPlan given = fail_together_on_error(group, parse);
  const AllToAllPlan plan =
      agree_plan(group, given.heads, given.layout, specs, given.seq,
                 call_options(tensor_names(kinds), mask, positions, causal, scale, step, check_mask,
                              window, softcap, sinks));
  return unaliased(detail::scatter_head_parts_kernel(nested, kinds, plan, group), parts);
}

std::vector<at::Tensor> scatter_head_parts_autograd(
    at::TensorList parts, Strings heads, int64_t q_heads, int64_t kv_heads,
    c10::IntArrayRef seq_lens, const std::string& layout, const std::string& group_name,
    c10::IntArrayRef group_options, bool agree, const OptTensor& mask, const OptTensor& positions,
    bool causal, double scale, bool step, bool check_mask, int64_t window, double softcap,
    const OptTensor& sinks) {
  static const auto op = handle<decltype(scatter_head_parts_op)>("ulysses::scatter_head_parts");
  std::vector<at::Tensor> outs = below_autograd([&] {
    return op.call(parts, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options,
                   agree, mask, positions, causal, scale, step, check_mask, window, softcap, sinks);
  });
  if (!needs_grad(parts)) return outs;
  const Group group = Group::from_op(group_name, group_options);
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, layout, group.size());
  detail::attach_backward(parts.vec(), outs, "ScatterHeadPartsBackward",
                          [kinds = parse_heads(heads), plan, group](std::vector<at::Tensor>&& g) {
                            return gather_head_parts(g, kinds, plan, group);
                          });
  return outs;
}

// gather_heads, or with `parts` gather_head_parts (tensor t's part from rank j at t * P + j).
std::vector<at::Tensor> gather_kernel(at::TensorList ys, Strings heads, int64_t q_heads,
                                      int64_t kv_heads, c10::IntArrayRef seq_lens,
                                      const std::string& layout, const std::string& group_name,
                                      c10::IntArrayRef group_options, bool parts) {
  const Group group = Group::from_op(group_name, group_options);
  const std::vector<Heads> kinds = parse_heads(heads);
  TORCH_CHECK_VALUE(kinds.size() == ys.size(), "gather_heads: ", ys.size(), " tensors but ",
                    kinds.size(), " head kinds");
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, layout, group.size());
  return unaliased(detail::gather_heads_kernel(ys.vec(), kinds, plan, group, parts), ys);
}

std::vector<at::Tensor> gather_heads_op(at::TensorList ys, Strings heads, int64_t q_heads,
                                        int64_t kv_heads, c10::IntArrayRef seq_lens,
                                        const std::string& layout, const std::string& group_name,
                                        c10::IntArrayRef group_options) {
  return gather_kernel(ys, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options,
                       false);
}

std::vector<at::Tensor> gather_head_parts_op(at::TensorList ys, Strings heads, int64_t q_heads,
                                             int64_t kv_heads, c10::IntArrayRef seq_lens,
                                             const std::string& layout,
                                             const std::string& group_name,
                                             c10::IntArrayRef group_options) {
  return gather_kernel(ys, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options,
                       true);
}

// The autograd of gather_heads (`parts` false) and gather_head_parts.
template <bool parts>
std::vector<at::Tensor> gather_autograd(at::TensorList ys, Strings heads, int64_t q_heads,
                                        int64_t kv_heads, c10::IntArrayRef seq_lens,
                                        const std::string& layout, const std::string& group_name,
                                        c10::IntArrayRef group_options) {
  static const auto op = handle<decltype(gather_heads_op)>(parts ? "ulysses::gather_head_parts"
                                                                 : "ulysses::gather_heads");
  std::vector<at::Tensor> outs = below_autograd([&] {
    return op.call(ys, heads, q_heads, kv_heads, seq_lens, layout, group_name, group_options);
  });
  if (!needs_grad(ys)) return outs;
  const Group group = Group::from_op(group_name, group_options);
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, layout, group.size());
  detail::attach_backward(ys.vec(), outs, parts ? "GatherHeadPartsBackward" : "GatherHeadsBackward",
                          [kinds = parse_heads(heads), plan, group](std::vector<at::Tensor>&& g) {
                            if (!parts) return scatter_heads(g, kinds, plan, group);
                            const auto P = static_cast<size_t>(group.size());
                            std::vector<std::vector<at::Tensor>> nested;
                            for (size_t t = 0; t < kinds.size(); ++t)
                              nested.emplace_back(g.begin() + t * P, g.begin() + (t + 1) * P);
                            return scatter_head_parts(nested, kinds, plan, group);
                          });
  return outs;
}

// ---- scatter_projected / gather_projected ---------------------------------------------------

using OptTensors = c10::List<c10::optional<at::Tensor>>;

std::vector<HeadProjection> projections_of(at::TensorList weights, const OptTensors& biases,
                                           Strings heads) {
  const std::vector<Heads> kinds = parse_heads(heads);
  TORCH_CHECK_VALUE(weights.size() == kinds.size() && biases.size() == kinds.size(),
                    "scatter_projected: need one weight, one bias (or None) and one head kind per "
                    "projection; got ",
                    weights.size(), " weights, ", biases.size(), " biases and ", kinds.size(),
                    " head kinds");
  std::vector<HeadProjection> out;
  for (size_t t = 0; t < kinds.size(); ++t) out.push_back({weights[t], biases.get(t), kinds[t]});
  return out;
}

std::vector<at::Tensor> projection_inputs(const at::Tensor& x,
                                          const std::vector<HeadProjection>& projections) {
  std::vector<at::Tensor> inputs{x};
  for (const HeadProjection& p : projections) inputs.push_back(p.weight);
  for (const HeadProjection& p : projections)
    if (p.bias) inputs.push_back(*p.bias);
  return inputs;
}

std::vector<at::Tensor> scatter_projected_op(const at::Tensor& x, at::TensorList weights,
                                             const OptTensors& biases, Strings heads,
                                             int64_t q_heads, int64_t kv_heads,
                                             c10::IntArrayRef seq_lens,
                                             const std::string& group_name,
                                             c10::IntArrayRef group_options, bool agree) {
  const Group group = Group::from_op(group_name, group_options);
  std::vector<HeadProjection> projections;
  auto parse = [&] {
    projections = projections_of(weights, biases, heads);
    return plan_of(q_heads, kv_heads, seq_lens, "BSHD", group.size());
  };
  AllToAllPlan plan = agree ? fail_together_on_error(group, parse) : parse();
  if (agree) plan = agree_projection_plan(group, plan.heads, x, projections, plan.seq);
  detail::check_scatter_projected(x, projections, plan, group);
  return detail::scatter_projected_kernel(x, projections, plan, group);
}

std::vector<at::Tensor> scatter_projected_backward_op(
    at::TensorList grads, const at::Tensor& x, at::TensorList weights, const OptTensors& biases,
    Strings heads, int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
    const std::string& group_name, c10::IntArrayRef group_options) {
  const Group group = Group::from_op(group_name, group_options);
  return detail::scatter_projected_backward_kernel(
      grads.vec(), x, projections_of(weights, biases, heads),
      plan_of(q_heads, kv_heads, seq_lens, "BSHD", group.size()), group);
}

std::vector<at::Tensor> scatter_projected_autograd(const at::Tensor& x, at::TensorList weights,
                                                   const OptTensors& biases, Strings heads,
                                                   int64_t q_heads, int64_t kv_heads,
                                                   c10::IntArrayRef seq_lens,
                                                   const std::string& group_name,
                                                   c10::IntArrayRef group_options, bool agree) {
  static const auto op = handle<decltype(scatter_projected_op)>("ulysses::scatter_projected");
  static const auto backward =
      handle<decltype(scatter_projected_backward_op)>("ulysses::scatter_projected_backward");
  std::vector<at::Tensor> outs = below_autograd([&] {
    return op.call(x, weights, biases, heads, q_heads, kv_heads, seq_lens, group_name,
                   group_options, agree);
  });
  // The kernel checked the arguments on every rank: parsing them again cannot fail.
  const std::vector<HeadProjection> projections = projections_of(weights, biases, heads);
  const std::vector<at::Tensor> inputs = projection_inputs(x, projections);
  if (!needs_grad(inputs)) return outs;
  std::vector<at::Tensor> saved_weights;
  OptTensors saved_biases;
  for (const HeadProjection& p : projections) {
    saved_weights.push_back(p.weight.detach());
    saved_biases.push_back(p.bias ? OptTensor(p.bias->detach()) : OptTensor());
  }
  detail::attach_backward(inputs, outs, "ScatterProjectedBackward",
                          [x = x.detach(), saved_weights, saved_biases, names = heads.vec(),
                           q_heads, kv_heads, lengths = seq_lens.vec(), group_name,
                           options = group_options.vec()](std::vector<at::Tensor>&& g) {
                            return backward.call(g, x, saved_weights, saved_biases, names, q_heads,
                                                 kv_heads, lengths, group_name, options);
                          });
  return outs;
}

std::vector<at::Tensor> gather_projected_op(const at::Tensor& y, const at::Tensor& weight,
                                            int64_t q_heads, int64_t kv_heads,
                                            c10::IntArrayRef seq_lens,
                                            const std::string& group_name,
                                            c10::IntArrayRef group_options, bool agree) {
  const Group group = Group::from_op(group_name, group_options);
  auto parse = [&] {
    AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, "BSHD", group.size());
    detail::check_gather_projected(y, weight, plan, group);
    return plan;
  };
  const AllToAllPlan plan = agree ? fail_together_on_error(group, parse) : parse();
  if (agree) {  // Every rank's o, sequence-sharded, stands in: batch, head dim, dtype, split.
    const at::Tensor o =
        y.new_empty({1, 1, 1, 1})
            .expand({y.size(0), plan.seq.length(group.rank()), plan.heads.q_heads(), y.size(3)});
    agree_plan(group, plan.heads, Layout::kBSHD, {{o, Heads::kQuery, "o"}}, plan.seq);
  }
  return detail::gather_projected_kernel(y, weight, plan, group);
}

std::tuple<at::Tensor, at::Tensor> gather_projected_backward_op(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& weight, at::TensorList parts,
    int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens, const std::string& group_name,
    c10::IntArrayRef group_options) {
  const Group group = Group::from_op(group_name, group_options);
  const auto d = detail::gather_projected_backward_kernel(
      grad, y, weight, parts.vec(), plan_of(q_heads, kv_heads, seq_lens, "BSHD", group.size()),
      group);
  return {d[0], d[1]};
}

std::vector<at::Tensor> gather_projected_autograd(const at::Tensor& y, const at::Tensor& weight,
                                                  int64_t q_heads, int64_t kv_heads,
                                                  c10::IntArrayRef seq_lens,
                                                  const std::string& group_name,
                                                  c10::IntArrayRef group_options, bool agree) {
  static const auto op = handle<decltype(gather_projected_op)>("ulysses::gather_projected");
  static const auto backward =
      handle<decltype(gather_projected_backward_op)>("ulysses::gather_projected_backward");
  std::vector<at::Tensor> outs = below_autograd([&] {
    return op.call(y, weight, q_heads, kv_heads, seq_lens, group_name, group_options, agree);
  });
  if (!needs_grad({y, weight})) return outs;
  std::vector<at::Tensor> out{outs[0]};
  detail::attach_backward({y, weight}, out, "GatherProjectedBackward",
                          [y = y.detach(), w = weight.detach(),
                           parts = std::vector<at::Tensor>(outs.begin() + 1, outs.end()), q_heads,
                           kv_heads, lengths = seq_lens.vec(), group_name,
                           options = group_options.vec()](std::vector<at::Tensor>&& g) {
                            auto [dy, dw] = backward.call(g[0], y, w, parts, q_heads, kv_heads,
                                                          lengths, group_name, options);
                            return std::vector<at::Tensor>{dy, dw};
                          });
  outs[0] = out[0];
  return outs;
}

// ---- all_gather_sequence / reduce_scatter_sequence ----------------------------------------

template <bool reduce>
at::Tensor sequence_op(const at::Tensor& x, int64_t dim, c10::IntArrayRef seq_lens,
                       const std::string& group_name, c10::IntArrayRef group_options, bool agree) {
  const Group group = Group::from_op(group_name, group_options);
  const auto seq = SequencePartition::from_lengths(seq_lens.vec());
  return unaliased(reduce ? detail::reduce_scatter_sequence_kernel(x, dim, seq, group, agree)
                          : detail::all_gather_sequence_kernel(x, dim, seq, group, agree),
                   {x});
}

template <bool reduce>
at::Tensor sequence_autograd(const at::Tensor& x, int64_t dim, c10::IntArrayRef seq_lens,
                             const std::string& group_name, c10::IntArrayRef group_options,
                             bool agree) {
  static const auto op = handle<decltype(sequence_op<reduce>)>(
      reduce ? "ulysses::reduce_scatter_sequence" : "ulysses::all_gather_sequence");
  std::vector<at::Tensor> outs{
      below_autograd([&] { return op.call(x, dim, seq_lens, group_name, group_options, agree); })};
  if (!needs_grad({x})) return outs[0];
  const Group group = Group::from_op(group_name, group_options);
  const auto seq = SequencePartition::from_lengths(seq_lens.vec());
  detail::attach_backward(
      {x}, outs, reduce ? "ReduceScatterSequenceBackward" : "AllGatherSequenceBackward",
      [dim, seq, group](std::vector<at::Tensor>&& g) {  // Shapes agreed in the forward.
        return std::vector<at::Tensor>{
            detail::call_sequence_collective(g[0], dim, seq, group, !reduce, /*agree=*/false)};
      });
  return outs[0];
}

// ---- rebuild_mask --------------------------------------------------------------------------

at::Tensor rebuild_mask_op(const at::Tensor& mask, int64_t q_heads, int64_t kv_heads,
                           c10::IntArrayRef seq_lens, const std::string& group_name,
                           c10::IntArrayRef group_options, int64_t key_len) {
  const Group group = Group::from_op(group_name, group_options);
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, "BHSD", group.size());
  return unaliased(as_4d_mask(detail::rebuild_mask_kernel(mask, plan, group, key_len)), {mask});
}

at::Tensor rebuild_mask_backward_op(const at::Tensor& grad, c10::IntArrayRef mask_sizes,
                                    int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                                    const std::string& group_name, c10::IntArrayRef group_options,
                                    int64_t key_len) {
  const Group group = Group::from_op(group_name, group_options);
  const AllToAllPlan plan = plan_of(q_heads, kv_heads, seq_lens, "BHSD", group.size());
  at::NoGradGuard no_grad;
  return unaliased(rebuild_mask_backward(grad, mask_sizes.vec(), plan, group, key_len), {grad});
}

at::Tensor rebuild_mask_autograd(const at::Tensor& mask, int64_t q_heads, int64_t kv_heads,
                                 c10::IntArrayRef seq_lens, const std::string& group_name,
                                 c10::IntArrayRef group_options, int64_t key_len) {
  static const auto op = handle<decltype(rebuild_mask_op)>("ulysses::rebuild_mask");
  static const auto backward =
      handle<decltype(rebuild_mask_backward_op)>("ulysses::rebuild_mask_backward");
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

// ---- flash_attention -----------------------------------------------------------------------

LocalAttentionArgs local_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              c10::IntArrayRef kv_map, const OptTensor& mask,
                              const OptTensor& positions, bool causal, double scale,
                              int64_t window = 0, double softcap = 0.0,
                              const OptTensor& sinks = {}) {
  LocalAttentionArgs a;
  a.q = q, a.k = k, a.v = v;
  a.kv_map = kv_map.vec();
  a.mask = mask;
  a.positions = positions;
  a.causal = causal;
  a.window = window;
  a.softcap = softcap;
  if (sinks && sinks->defined()) a.sinks = sinks;
  a.scale = scale;
  return a;
}

// Note [Attention sinks]: a sink is one more key per head, with logit sinks[h] and value 0. On
// a finished attention (out, lse) it is a merge with an empty block (exact), and the backward
// kernels, run on the merged out and lse, give dq, dk, dv unchanged: p = exp(s - lse) are then
// the probabilities with the sink, and ds = p * (dp - rowsum(do * o)) holds as it is.
std::tuple<at::Tensor, at::Tensor> with_sinks(const at::Tensor& out, const at::Tensor& lse,
                                              const OptTensor& sinks) {
  if (!sinks || !sinks->defined()) return {out, lse};
  at::Tensor o = out.to(at::kFloat);
  at::Tensor logits = sinks->detach().to(at::kFloat).view({1, -1, 1}).expand_as(lse);
  auto [merged, merged_lse] = merge_attention(o, lse, at::zeros_like(o), logits);
  return {merged.to(out.scalar_type()).contiguous(), merged_lse.contiguous()};
}

// d/dsinks[h] = -sum over h's rows of p_sink * rowsum(do * o), p_sink = exp(sinks[h] - lse),
// from the merged out and lse.
at::Tensor sinks_grad(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& sinks) {
  at::Tensor p_sink = (sinks.to(at::kFloat).view({1, -1, 1}) - lse).exp();
  at::Tensor delta = (grad_out.to(at::kFloat) * out.to(at::kFloat)).sum(-1);
  return (p_sink * delta).sum({0, 2}).neg().to(sinks.scalar_type());
}

bool learns_sinks(const OptTensor& sinks) {
  return sinks && sinks->defined() && sinks->requires_grad();
}

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

bool learns_mask(const OptTensor& mask) {
  return mask && mask->defined() && mask->is_floating_point() && mask->requires_grad();
}

std::tuple<at::Tensor, at::Tensor> flash_attention_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::IntArrayRef kv_map,
    const OptTensor& mask, const OptTensor& positions, bool causal, double scale,
    at::TensorList rows, int64_t block_q, int64_t block_k, int64_t window, double softcap,
    const OptTensor& sinks) {
  LocalAttentionArgs a =
      local_args(q, k, v, kv_map, mask, positions, causal, scale, window, softcap);
  a.rows = rows_of(rows);
  check_sinks(sinks, q.size(1));
  auto [out, lse] = flash_attention_forward(a, FlashOptions{block_q, block_k});
  return with_sinks(out.contiguous(), lse.contiguous(), sinks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::IntArrayRef kv_map, const OptTensor& mask,
    const OptTensor& positions, bool causal, double scale, bool mask_grad, at::TensorList rows,
    int64_t block_q, int64_t block_k, int64_t window, double softcap) {
  LocalAttentionArgs a =
      local_args(q, k, v, kv_map, mask, positions, causal, scale, window, softcap);
  a.rows = rows_of(rows);
  auto g =
      flash_attention_backward(grad_out, a, out, lse, mask_grad, FlashOptions{block_q, block_k});
  // No mask gradient: an empty tensor (a dispatcher op cannot return an undefined one).
  if (!g[3].defined()) g[3] = at::empty({0}, q.options());
  return {g[0].contiguous(), g[1].contiguous(), g[2].contiguous(), g[3].contiguous()};
}

// The inputs a local attention is differentiable in: q, k, v and a learnable float mask.
std::vector<at::Tensor> attention_inputs(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const OptTensor& mask) {
  std::vector<at::Tensor> inputs{q, k, v};
  if (learns_mask(mask)) inputs.push_back(*mask);
  return inputs;
}

// Detached copies of what a backward node keeps: saving an output itself would make a cycle
// (out -> grad_fn -> node -> out) and leak every step's graph.
OptTensor detached(const OptTensor& t) {
  return t && t->defined() ? OptTensor(t->detach()) : OptTensor();
}

std::tuple<at::Tensor, at::Tensor> flash_attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::IntArrayRef kv_map,
    const OptTensor& mask, const OptTensor& positions, bool causal, double scale,
    at::TensorList rows, int64_t block_q, int64_t block_k, int64_t window, double softcap,
    const OptTensor& sinks) {
  static const auto op = handle<decltype(flash_attention_op)>("ulysses::flash_attention");
  static const auto backward =
      handle<decltype(flash_attention_backward_op)>("ulysses::flash_attention_backward");
  auto [out, lse] = below_autograd([&] {
    return op.call(q, k, v, kv_map, mask, positions, causal, scale, rows, block_q, block_k, window,
                   softcap, sinks);
  });
  std::vector<at::Tensor> inputs = attention_inputs(q, k, v, mask);
  const bool mask_grad = inputs.size() == 4, sink_grad = learns_sinks(sinks);
  if (sink_grad) inputs.push_back(*sinks);
  if (!needs_grad(inputs)) return {out, lse};
  std::vector<at::Tensor> outs{out};
  detail::attach_backward(inputs, outs, "FlashAttentionBackward",
                          [q = q.detach(), k = k.detach(), v = v.detach(), o = out.detach(), lse,
                           map = kv_map.vec(), mask = detached(mask), positions, causal, scale,
                           mask_grad, block_q, block_k, window, softcap, rows = rows.vec(),
                           sinks = detached(sinks), sink_grad](std::vector<at::Tensor>&& g) {
                            auto [dq, dk, dv, dmask] = backward.call(
                                g[0], q, k, v, o, lse, map, mask, positions, causal, scale,
                                mask_grad, rows, block_q, block_k, window, softcap);
                            std::vector<at::Tensor> grads{dq, dk, dv};
                            if (mask_grad) grads.push_back(dmask);
                            if (sink_grad) grads.push_back(sinks_grad(g[0], o, lse, *sinks));
                            return grads;
                          });
  return {outs[0], lse};
}

// ---- ring_attention ------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> ring_attention_op(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, c10::IntArrayRef kv_map,
                                                     const OptTensor& mask, const OptTensor& docs,
                                                     bool causal, double scale, int64_t seq_len,
                                                     int64_t ulysses, const std::string& ring_group,
                                                     c10::IntArrayRef group_options, int64_t window,
                                                     double softcap, const OptTensor& sinks) {
  const Group ring = Group::from_op(ring_group, group_options);
  const RingLayout layout = RingLayout::make(seq_len, ulysses, ring.size());
  check_sinks(sinks, q.size(1));
  // Eager only (no fake kernel): the outputs keep the kernel's strides, which the backward's
  // row sums read in the same order as the forward wrote them. Sinks join the merged result
  // once (Note [Attention sinks]).
  auto [out, lse] =
      ring_attention_forward(local_args(q, k, v, kv_map, mask, {}, causal, scale, window, softcap),
                             layout, docs.value_or(at::Tensor()), ring);
  return with_sinks(out, lse, sinks);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ring_attention_backward_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::IntArrayRef kv_map, const OptTensor& mask,
    const OptTensor& docs, bool causal, double scale, int64_t seq_len, int64_t ulysses,
    const std::string& ring_group, c10::IntArrayRef group_options, bool mask_grad, int64_t window,
    double softcap) {
  const Group ring = Group::from_op(ring_group, group_options);
  const RingLayout layout = RingLayout::make(seq_len, ulysses, ring.size());
  auto g = ring_attention_backward(
      grad_out, local_args(q, k, v, kv_map, mask, {}, causal, scale, window, softcap), layout,
      docs.value_or(at::Tensor()), ring, out, lse, mask_grad);
  if (!g[3].defined()) g[3] = at::empty({0}, q.options());
  return {g[0].contiguous(), g[1].contiguous(), g[2].contiguous(), g[3].contiguous()};
}

std::tuple<at::Tensor, at::Tensor> ring_attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::IntArrayRef kv_map,
    const OptTensor& mask, const OptTensor& docs, bool causal, double scale, int64_t seq_len,
    int64_t ulysses, const std::string& ring_group, c10::IntArrayRef group_options, int64_t window,
    double softcap, const OptTensor& sinks) {
  static const auto op = handle<decltype(ring_attention_op)>("ulysses::ring_attention");
  static const auto backward =
      handle<decltype(ring_attention_backward_op)>("ulysses::ring_attention_backward");
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
       sink_grad](std::vector<at::Tensor>&& g) {
        auto [dq, dk, dv, dmask] =
            backward.call(g[0], q, k, v, o, lse, map, mask, docs, causal, scale, seq_len, ulysses,
                          ring_group, options, mask_grad, window, softcap);
        std::vector<at::Tensor> grads{dq, dk, dv};
        if (mask_grad) grads.push_back(dmask);
        if (sink_grad) grads.push_back(sinks_grad(g[0], o, lse, *sinks));
        return grads;
      });
  return {outs[0], lse};
}

at::Tensor ring_document_ids_op(const at::Tensor& positions, int64_t seq_len, int64_t ulysses,
                                const std::string& ring_group, c10::IntArrayRef group_options) {
  const Group ring = Group::from_op(ring_group, group_options);
  at::NoGradGuard no_grad;
  return unaliased(
      ring_document_ids(positions, RingLayout::make(seq_len, ulysses, ring.size()), ring),
      {positions});
}

// ---- sum_over_group ------------------------------------------------------------------------

at::Tensor sum_over_group_op(const at::Tensor& x, const std::string& group_name,
                             c10::IntArrayRef group_options) {
  const Group group = Group::from_op(group_name, group_options);
  at::Tensor out = x.contiguous().clone();
  group.all_reduce_sum(out);
  return out;
}

// Each rank backpropagates its own part of a sum over the group: the gradient passes through
// unchanged, and summing parameter gradients over the group afterwards gives the exact total.
at::Tensor sum_over_group_autograd(const at::Tensor& x, const std::string& group_name,
                                   c10::IntArrayRef group_options) {
  static const auto op = handle<decltype(sum_over_group_op)>("ulysses::sum_over_group");
  std::vector<at::Tensor> outs{
      below_autograd([&] { return op.call(x, group_name, group_options); })};
  if (!needs_grad({x})) return outs[0];
  detail::attach_backward({x}, outs, "SumOverGroupBackward",
                          [](std::vector<at::Tensor>&& g) { return std::move(g); });
  return outs[0];
}

// ---- training: batch sharding, the global loss, gradient reduction (sharding.h) -----------

// [input ids, targets, position ids] and the padding mask when given, of SP rank `rank` of
// `world` (ring > 1: the hybrid layout's zigzag tokens).
std::vector<at::Tensor> shard_batch_op(const at::Tensor& input_ids, const OptTensor& labels,
                                       const OptTensor& attention_mask,
                                       const OptTensor& position_ids, int64_t rank, int64_t world,
                                       int64_t ring, int64_t ignore_index) {
  TORCH_CHECK_VALUE(world >= 1 && ring >= 1 && world % ring == 0 && rank >= 0 && rank < world,
                    "shard_batch: need 0 <= rank < world and ring dividing world; got rank ", rank,
                    ", world ", world, ", ring ", ring);
  TORCH_CHECK_VALUE(input_ids.dim() == 2, "shard_batch: input_ids must be [B, S]; got ",
                    input_ids.sizes());
  const TokenBatch global{input_ids, labels.value_or(at::Tensor()),
                          position_ids.value_or(at::Tensor()),
                          attention_mask.value_or(at::Tensor())};
  const int64_t S = input_ids.size(1);
  const TokenBatch shard =
      ring == 1 ? shard_batch(global, SequencePartition::even(S, world), rank, ignore_index)
                : shard_batch(global, RingLayout::make(S, world / ring, ring), rank, ignore_index);
  std::vector<at::Tensor> out{shard.input_ids, shard.labels, shard.position_ids};
  if (shard.attention_mask.defined()) out.push_back(shard.attention_mask);
  return out;
}

// (this rank's loss to backpropagate, the global mean as a detached 0-dim tensor).
std::tuple<at::Tensor, at::Tensor> sharded_cross_entropy_op(const at::Tensor& logits,
                                                            const at::Tensor& targets,
                                                            const std::string& group_name,
                                                            c10::IntArrayRef group_options,
                                                            int64_t ignore_index) {
  const ShardedLoss loss = sharded_cross_entropy(
      logits, targets, Group::from_op(group_name, group_options), ignore_index);
  return {loss.loss, at::scalar_tensor(loss.global_loss, loss.loss.options())};
}

std::tuple<at::Tensor, at::Tensor> token_mean_op(const at::Tensor& token_sum,
                                                 const at::Tensor& targets,
                                                 const std::string& group_name,
                                                 c10::IntArrayRef group_options,
                                                 int64_t ignore_index) {
  const ShardedLoss loss =
      token_mean(token_sum, targets, Group::from_op(group_name, group_options), ignore_index);
  return {loss.loss, at::scalar_tensor(loss.global_loss, loss.loss.options())};
}

void all_reduce_gradients_op(at::TensorList grads, const std::string& group_name,
                             c10::IntArrayRef group_options) {
  all_reduce_gradients(grads.vec(), Group::from_op(group_name, group_options));
}

// ---- local_attention and attention (composite: the one orchestration) ----------------------

at::Tensor local_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              c10::IntArrayRef kv_map, const OptTensor& mask,
                              const OptTensor& positions, bool causal, double scale,
                              const std::string& kernel, int64_t window, double softcap,
                              const OptTensor& sinks) {
  return local_attention(
      local_args(q, k, v, kv_map, mask, positions, causal, scale, window, softcap, sinks),
      parse_local_kernel(kernel));
}

// Everything but the tensors of one `attention` op call, as the C++ orchestration takes it.
AttentionCall attention_call(int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                             const std::string& layout, bool causal, double scale,
                             const std::string& local, const std::string& group_name,
                             c10::IntArrayRef group_options,
                             const c10::optional<std::string>& ring_group, const StepHandle& step,
                             bool mask_rebuilt, int64_t window, double softcap,
                             const OptTensor& sinks) {
  AttentionCall call(Group::from_op(group_name, group_options));
  if (ring_group) call.ring = Group::from_op(*ring_group, group_options);
  call.q_heads = q_heads;
  call.kv_heads = kv_heads;
  if (!seq_lens.empty()) call.seq = SequencePartition::from_lengths(seq_lens.vec());
  call.layout = parse_layout(layout);
  call.causal = causal;
  call.scale = scale;
  call.window = window;
  call.softcap = softcap;
  if (sinks && sinks->defined()) call.sinks = sinks;
  call.kernel = parse_local_kernel(local);
  if (step && *step) call.step = &(*step)->context_for(call.group);
  call.mask_rebuilt = mask_rebuilt;
  return call;
}

at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const OptTensor& mask, const OptTensor& positions, int64_t q_heads,
                        int64_t kv_heads, c10::IntArrayRef seq_lens, const std::string& layout,
                        bool causal, double scale, const std::string& local,
                        const std::string& group_name, c10::IntArrayRef group_options,
                        const c10::optional<std::string>& ring_group, const StepHandle& step,
                        bool mask_rebuilt, int64_t window, double softcap, const OptTensor& sinks) {
  const AttentionCall call =
      attention_call(q_heads, kv_heads, seq_lens, layout, causal, scale, local, group_name,
                     group_options, ring_group, step, mask_rebuilt, window, softcap, sinks);
  return attend(call, {{q}, {k}, {v}}, /*parts=*/false, mask, positions)[0];
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
  return attend(call, {q.vec(), k.vec(), v.vec()}, /*parts=*/true, mask, positions);
}

// The orchestration up to local attention, for a local attention of the caller's (a Python
// callable): [q, k, v] on this rank's heads over the whole sequence (BHSD), then the rebuilt
// mask and the gathered position ids where given.
std::vector<at::Tensor> attention_heads_op(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const OptTensor& mask,
                                           const OptTensor& positions, int64_t q_heads,
                                           int64_t kv_heads, c10::IntArrayRef seq_lens,
                                           const std::string& layout, bool causal, double scale,
                                           const std::string& group_name,
                                           c10::IntArrayRef group_options, const StepHandle& step,
                                           bool mask_rebuilt, int64_t window, double softcap) {
  const AttentionCall call =
      attention_call(q_heads, kv_heads, seq_lens, layout, causal, scale, "auto", group_name,
                     group_options, c10::nullopt, step, mask_rebuilt, window, softcap, {});
  const AttentionHeads h = attend_heads(call, {{q}, {k}, {v}}, /*parts=*/false, mask, positions);
  std::vector<at::Tensor> out{h.args.q, h.args.k, h.args.v};
  if (h.args.mask) out.push_back(*h.args.mask);
  if (h.args.positions) out.push_back(*h.args.positions);
  return out;
}

}  // namespace

// ---- the library's calls into its ops ------------------------------------------------------

namespace detail {

std::vector<at::Tensor> call_scatter_heads(const std::vector<at::Tensor>& xs,
                                           const std::vector<Heads>& kinds,
                                           const AllToAllPlan& plan, const Group& group) {
  static const auto op = handle<decltype(scatter_heads_op)>("ulysses::scatter_heads");
  return op.call(xs, heads_names(kinds), plan.heads.q_heads(), plan.heads.kv_heads(),
                 plan.seq.lengths(), to_string(plan.layout), group.op_name(),
                 options_to_ints(group.options()), /*agree=*/false, {}, {}, false, 0.0, false, true,
                 0, 0.0, {});
}

std::vector<at::Tensor> call_scatter_head_parts(const std::vector<std::vector<at::Tensor>>& parts,
                                                const std::vector<Heads>& kinds,
                                                const AllToAllPlan& plan, const Group& group) {
  static const auto op = handle<decltype(scatter_head_parts_op)>("ulysses::scatter_head_parts");
  std::vector<at::Tensor> flat;
  for (const auto& p : parts) flat.insert(flat.end(), p.begin(), p.end());
  return op.call(flat, heads_names(kinds), plan.heads.q_heads(), plan.heads.kv_heads(),
                 plan.seq.lengths(), to_string(plan.layout), group.op_name(),
                 options_to_ints(group.options()), /*agree=*/false, {}, {}, false, 0.0, false, true,
                 0, 0.0, {});
}

std::vector<at::Tensor> call_scatter_agreed(const std::vector<std::vector<at::Tensor>>& qkv,
                                            bool parts, const std::vector<Heads>& kinds,
                                            int64_t q_heads, int64_t kv_heads,
                                            const SequencePartition& seq, Layout layout,
                                            const Group& group, const CallOptions& options) {
  static const auto whole = handle<decltype(scatter_heads_op)>("ulysses::scatter_heads");
  static const auto by_part =
      handle<decltype(scatter_head_parts_op)>("ulysses::scatter_head_parts");
  std::vector<at::Tensor> flat;
  for (const auto& t : qkv) flat.insert(flat.end(), t.begin(), t.end());
  return (parts ? by_part : whole)
      .call(flat, heads_names(kinds), q_heads, kv_heads, seq.lengths(), to_string(layout),
            group.op_name(), options_to_ints(group.options()), /*agree=*/true, options.mask,
            options.positions, options.causal, options.scale, options.step_context,
            options.check_mask, options.window, options.softcap, options.sinks);
}

std::vector<at::Tensor> call_gather_heads(const std::vector<at::Tensor>& ys,
                                          const std::vector<Heads>& kinds, const AllToAllPlan& plan,
                                          const Group& group, bool parts) {
  static const auto gather = handle<decltype(gather_heads_op)>("ulysses::gather_heads");
  static const auto gather_parts = handle<decltype(gather_heads_op)>("ulysses::gather_head_parts");
  return (parts ? gather_parts : gather)
      .call(ys, heads_names(kinds), plan.heads.q_heads(), plan.heads.kv_heads(), plan.seq.lengths(),
            to_string(plan.layout), group.op_name(), options_to_ints(group.options()));
}

at::Tensor call_sequence_collective(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                    const Group& group, bool reduce, bool agree) {
  static const auto gather = handle<decltype(sequence_op<false>)>("ulysses::all_gather_sequence");
  static const auto scatter =
      handle<decltype(sequence_op<true>)>("ulysses::reduce_scatter_sequence");
  return (reduce ? scatter : gather)
      .call(x, dim, seq.lengths(), group.op_name(), options_to_ints(group.options()), agree);
}

at::Tensor call_rebuild_mask(const at::Tensor& mask, const AllToAllPlan& plan, const Group& group,
                             int64_t key_len) {
  static const auto op = handle<decltype(rebuild_mask_op)>("ulysses::rebuild_mask");
  return op.call(mask, plan.heads.q_heads(), plan.heads.kv_heads(), plan.seq.lengths(),
                 group.op_name(), options_to_ints(group.options()), key_len);
}

std::vector<at::Tensor> call_scatter_projected(const at::Tensor& x,
                                               const std::vector<HeadProjection>& projections,
                                               const AllToAllPlan& plan, const Group& group) {
  static const auto op = handle<decltype(scatter_projected_op)>("ulysses::scatter_projected");
  std::vector<at::Tensor> weights;
  std::vector<std::string> heads;
  OptTensors biases;
  for (const HeadProjection& p : projections) {
    weights.push_back(p.weight);
    biases.push_back(p.bias);
    heads.push_back(p.heads == Heads::kQuery ? "q" : "kv");
  }
  return op.call(x, weights, biases, heads, plan.heads.q_heads(), plan.heads.kv_heads(),
                 plan.seq.lengths(), group.op_name(), options_to_ints(group.options()),
                 /*agree=*/false);
}

at::Tensor call_gather_projected(const at::Tensor& y, const at::Tensor& weight,
                                 const AllToAllPlan& plan, const Group& group) {
  static const auto op = handle<decltype(gather_projected_op)>("ulysses::gather_projected");
  return op.call(y, weight, plan.heads.q_heads(), plan.heads.kv_heads(), plan.seq.lengths(),
                 group.op_name(), options_to_ints(group.options()), /*agree=*/false)[0];
}

std::tuple<at::Tensor, at::Tensor> call_flash_attention(const LocalAttentionArgs& a,
                                                        const FlashOptions& options) {
  static const auto op = handle<decltype(flash_attention_op)>("ulysses::flash_attention");
  return op.call(a.q, a.k, a.v, a.kv_map, a.mask, a.positions, a.causal, a.scale, rows_list(a.rows),
                 options.block_q, options.block_k, a.window, a.softcap, a.sinks);
}

std::tuple<at::Tensor, at::Tensor> call_ring_attention(const LocalAttentionArgs& a,
                                                       const RingLayout& layout,
                                                       const at::Tensor& docs, const Group& ring) {
  static const auto op = handle<decltype(ring_attention_op)>("ulysses::ring_attention");
  TORCH_CHECK_VALUE(!a.positions && !a.rows,
                    "ring_attention: packed documents come as `docs` (ring_document_ids)");
  return op.call(a.q, a.k, a.v, a.kv_map, a.mask, docs.defined() ? OptTensor(docs) : OptTensor(),
                 a.causal, a.scale, layout.seq_len(), layout.ulysses(), ring.op_name(),
                 options_to_ints(ring.options()), a.window, a.softcap, a.sinks);
}

}  // namespace detail

TORCH_LIBRARY(ulysses, m) {
  m.class_<StepContextHolder>("StepContext")
      .def(torch::init<>())
      .def("reuses", &StepContextHolder::reuses);
  const std::vector<at::Tag> pt2{at::Tag::pt2_compliant_tag};
  // `group`: a torch.distributed group name ("" for this rank alone); `group_options`:
  // [timeout ms, pipeline_min_bytes, message_bytes], a shorter list leaving defaults.
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
  // Projections overlapped with the exchanges (all_to_all.h), BSHD. gather_projected returns
  // its output, then the blocks it received (backward's dW needs them).
  m.def(
      "scatter_projected(Tensor x, Tensor[] weights, Tensor?[] biases, str[] heads, int q_heads, "
      "int kv_heads, int[] seq_lens, str group, int[] group_options, bool agree=True) -> Tensor[]",
      pt2);
  m.def(
      "scatter_projected_backward(Tensor[] grads, Tensor x, Tensor[] weights, Tensor?[] biases, "
      "str[] heads, int q_heads, int kv_heads, int[] seq_lens, str group, int[] group_options) "
      "-> Tensor[]",
      pt2);
  m.def(
      "gather_projected(Tensor y, Tensor weight, int q_heads, int kv_heads, int[] seq_lens, "
      "str group, int[] group_options, bool agree=True) -> Tensor[]",
      pt2);
  m.def(
      "gather_projected_backward(Tensor grad, Tensor y, Tensor weight, Tensor[] parts, "
      "int q_heads, int kv_heads, int[] seq_lens, str group, int[] group_options) "
      "-> (Tensor, Tensor)",
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
  m.def(
      "rebuild_mask(Tensor mask, int q_heads, int kv_heads, int[] seq_lens, str group, "
      "int[] group_options, int key_len=-1) -> Tensor",
      pt2);
  m.def(
      "rebuild_mask_backward(Tensor grad, int[] mask_sizes, int q_heads, int kv_heads, "
      "int[] seq_lens, str group, int[] group_options, int key_len=-1) -> Tensor",
      pt2);
  m.def(
      "flash_attention(Tensor q, Tensor k, Tensor v, int[] kv_map, Tensor? mask, "
      "Tensor? positions, bool causal, float scale, Tensor[] rows, int block_q=0, "
      "int block_k=0, int window=0, float softcap=0., Tensor? sinks=None) -> (Tensor, Tensor)",
      pt2);
  m.def(
      "flash_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, int[] kv_map, Tensor? mask, Tensor? positions, bool causal, float scale, "
      "bool mask_grad, Tensor[] rows, int block_q=0, int block_k=0, int window=0, float "
      "softcap=0.) -> "
      "(Tensor, Tensor, Tensor, Tensor)",
      pt2);
  // Ring attention over `ring_group` for this ring rank's tokens of RingLayout(seq_len,
  // ulysses, ring size); docs: [B or 1, seq_len] global document ids.
  m.def(
      "ring_attention(Tensor q, Tensor k, Tensor v, int[] kv_map, Tensor? mask, Tensor? docs, "
      "bool causal, float scale, int seq_len, int ulysses, str ring_group, int[] group_options, "
      "int window=0, float softcap=0., Tensor? sinks=None) -> (Tensor, Tensor)");
  m.def(
      "ring_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, int[] kv_map, Tensor? mask, Tensor? docs, bool causal, float scale, "
      "int seq_len, int ulysses, str ring_group, int[] group_options, bool mask_grad, "
      "int window=0, float softcap=0.) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ring_document_ids(Tensor positions, int seq_len, int ulysses, str ring_group, "
      "int[] group_options) -> Tensor");
  m.def("sum_over_group(Tensor x, str group, int[] group_options) -> Tensor", pt2);
  // Training (sharding.h): a global causal-LM batch's shard for SP rank `rank` of `world`,
  // the exact global mean loss, and gradients summed in place.
  m.def(
      "shard_batch(Tensor input_ids, Tensor? labels, Tensor? attention_mask, "
      "Tensor? position_ids, int rank, int world, int ring=1, int ignore_index=-100) "
      "-> Tensor[]");
  m.def(
      "sharded_cross_entropy(Tensor logits, Tensor targets, str group, int[] group_options, "
      "int ignore_index=-100) -> (Tensor, Tensor)");
  m.def(
      "token_mean(Tensor token_sum, Tensor targets, str group, int[] group_options, "
      "int ignore_index=-100) -> (Tensor, Tensor)");
  m.def("all_reduce_gradients(Tensor(a!)[] grads, str group, int[] group_options) -> ()");
  // Local attention on the exact kernel `kernel` picks ("auto": the rule in attention.h).
  m.def(
      "local_attention(Tensor q, Tensor k, Tensor v, int[] kv_map, Tensor? mask, "
      "Tensor? positions, bool causal, float scale, str kernel=\"auto\", int window=0, float "
      "softcap=0., Tensor? sinks=None) -> Tensor",
      pt2);
  // One DistributedAttention call (distributed_attention.h): empty seq_lens are learned in the
  // call's agreement (eager only); `step` shares rebuilt masks across layers (eager only);
  // `mask_rebuilt`: the mask is already rebuild_mask's output for these heads.
  const char* call_args =
      "Tensor? mask, Tensor? positions, int q_heads, int kv_heads, int[] seq_lens, str layout, "
      "bool causal, float scale, str local, str group, int[] group_options, "
      "str? ring_group=None, __torch__.torch.classes.ulysses.StepContext? step=None, "
      "bool mask_rebuilt=False, int window=0, float softcap=0., Tensor? sinks=None)";
  static const std::string attention =
      std::string("attention(Tensor q, Tensor k, Tensor v, ") + call_args + " -> Tensor";
  static const std::string attention_parts =
      std::string("attention_parts(Tensor[] q, Tensor[] k, Tensor[] v, ") + call_args +
      " -> Tensor[]";
  m.def(attention.c_str());
  m.def(attention_parts.c_str());
  m.def(
      "attention_heads(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? positions, "
      "int q_heads, int kv_heads, int[] seq_lens, str layout, bool causal, float scale, "
      "str group, int[] group_options, __torch__.torch.classes.ulysses.StepContext? step=None, "
      "bool mask_rebuilt=False, int window=0, float softcap=0.) -> Tensor[]");
}

// Collectives: one kernel for every device (the ProcessGroup dispatches by device).
TORCH_LIBRARY_IMPL(ulysses, CompositeExplicitAutograd, m) {
  m.impl("sequence_lengths", &sequence_lengths_op);
  m.impl("scatter_heads", &scatter_heads_op);
  m.impl("gather_heads", &gather_heads_op);
  m.impl("scatter_head_parts", &scatter_head_parts_op);
  m.impl("gather_head_parts", &gather_head_parts_op);
  m.impl("scatter_projected", &scatter_projected_op);
  m.impl("scatter_projected_backward", &scatter_projected_backward_op);
  m.impl("gather_projected", &gather_projected_op);
  m.impl("gather_projected_backward", &gather_projected_backward_op);
  m.impl("all_gather_sequence", &sequence_op<false>);
  m.impl("reduce_scatter_sequence", &sequence_op<true>);
  m.impl("rebuild_mask", &rebuild_mask_op);
  m.impl("rebuild_mask_backward", &rebuild_mask_backward_op);
  m.impl("ring_document_ids", &ring_document_ids_op);
  m.impl("sum_over_group", &sum_over_group_op);
  m.impl("all_reduce_gradients", &all_reduce_gradients_op);
}

// The fused kernels are CPU code (other devices take SDPA: the local-attention rule).
TORCH_LIBRARY_IMPL(ulysses, CPU, m) {
  m.impl("flash_attention", &flash_attention_op);
  m.impl("flash_attention_backward", &flash_attention_backward_op);
  m.impl("ring_attention", &ring_attention_op);
  m.impl("ring_attention_backward", &ring_attention_backward_op);
}

TORCH_LIBRARY_IMPL(ulysses, Autograd, m) {
  m.impl("scatter_heads", &scatter_heads_autograd);
  m.impl("gather_heads", &gather_autograd<false>);
  m.impl("scatter_head_parts", &scatter_head_parts_autograd);
  m.impl("gather_head_parts", &gather_autograd<true>);
  m.impl("scatter_projected", &scatter_projected_autograd);
  m.impl("gather_projected", &gather_projected_autograd);
  m.impl("all_gather_sequence", &sequence_autograd<false>);
  m.impl("reduce_scatter_sequence", &sequence_autograd<true>);
  m.impl("rebuild_mask", &rebuild_mask_autograd);
  m.impl("flash_attention", &flash_attention_autograd);
  m.impl("ring_attention", &ring_attention_autograd);
  m.impl("sum_over_group", &sum_over_group_autograd);
}

// The orchestration: composite, so eager runs it through the ops above and torch.compile
// traces those ops (their fake kernels and autograd).
TORCH_LIBRARY_IMPL(ulysses, CompositeImplicitAutograd, m) {
  m.impl("local_attention", &local_attention_op);
  m.impl("shard_batch", &shard_batch_op);
  m.impl("sharded_cross_entropy", &sharded_cross_entropy_op);
  m.impl("token_mean", &token_mean_op);
  m.impl("attention", &attention_op);
  m.impl("attention_parts", &attention_parts_op);
  m.impl("attention_heads", &attention_heads_op);
}

}  // namespace ulysses
