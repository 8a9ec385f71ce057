// torch.ops.ulysses, the transport floor's projected exchanges: scatter_projected and
// gather_projected (all_to_all.h), the input and output projections overlapped with the
// exchanges, and their backward ops. Conventions as in transport/ops.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "dispatch/autograd.h"
#include "dispatch/op_util.h"
#include "transport/op_options.h"
#include "transport/ops.h"
#include "ulysses/all_to_all.h"
#include "ulysses/group.h"

namespace ulysses {
namespace {

using namespace detail;  // NOLINT: this floor's op helpers and kernels.

std::vector<HeadProjection> projections_of(at::TensorList weights, const OptTensors& biases,
                                           Strings heads) {
  const std::vector<Heads> tensor_heads = parse_heads(heads);
  TORCH_CHECK_VALUE(weights.size() == tensor_heads.size() && biases.size() == tensor_heads.size(),
                    "scatter_projected: need one weight, one bias (or None) and one head kind per "
                    "projection; got ",
                    weights.size(), " weights, ", biases.size(), " biases and ",
                    tensor_heads.size(), " head tensor_heads");
  std::vector<HeadProjection> out;
  for (size_t t = 0; t < tensor_heads.size(); ++t)
    out.push_back({weights[t], biases.get(t), tensor_heads[t]});
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
  const Group group = group_of_op(group_name, group_options);
  std::vector<HeadProjection> projections;
  auto parse = [&] {
    projections = projections_of(weights, biases, heads);
    return sharding_of(q_heads, kv_heads, seq_lens, "BSHD", group.size());
  };
  Sharding sharding = agree ? fail_together_on_error(group, parse) : parse();
  if (agree) sharding = agree_projection_plan(group, sharding.heads, x, projections, sharding.seq);
  detail::check_scatter_projected(x, projections, sharding, group);
  return detail::scatter_projected_kernel(x, projections, sharding, group);
}

std::vector<at::Tensor> scatter_projected_backward_op(
    at::TensorList grads, const at::Tensor& x, at::TensorList weights, const OptTensors& biases,
    Strings heads, int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
    const std::string& group_name, c10::IntArrayRef group_options) {
  const Group group = group_of_op(group_name, group_options);
  return detail::scatter_projected_backward_kernel(
      grads.vec(), x, projections_of(weights, biases, heads),
      sharding_of(q_heads, kv_heads, seq_lens, "BSHD", group.size()), group);
}

std::vector<at::Tensor> scatter_projected_autograd(const at::Tensor& x, at::TensorList weights,
                                                   const OptTensors& biases, Strings heads,
                                                   int64_t q_heads, int64_t kv_heads,
                                                   c10::IntArrayRef seq_lens,
                                                   const std::string& group_name,
                                                   c10::IntArrayRef group_options, bool agree) {
  static const auto op = op_handle<decltype(scatter_projected_op)>("ulysses::scatter_projected");
  static const auto backward =
      op_handle<decltype(scatter_projected_backward_op)>("ulysses::scatter_projected_backward");
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
  const Group group = group_of_op(group_name, group_options);
  auto parse = [&] {
    Sharding sharding = sharding_of(q_heads, kv_heads, seq_lens, "BSHD", group.size());
    detail::check_gather_projected(y, weight, sharding, group);
    return sharding;
  };
  const Sharding sharding = agree ? fail_together_on_error(group, parse) : parse();
  if (agree) {  // Every rank's o, sequence-sharded, stands in: batch, head dim, dtype, split.
    const at::Tensor o = y.new_empty({1, 1, 1, 1})
                             .expand({y.size(0), sharding.seq.length(group.rank()),
                                      sharding.heads.q_heads(), y.size(3)});
    agree_plan(group, sharding.heads, Layout::kBSHD, {{o, Heads::kQuery, "o"}}, sharding.seq);
  }
  return detail::gather_projected_kernel(y, weight, sharding, group);
}

std::tuple<at::Tensor, at::Tensor> gather_projected_backward_op(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& weight, at::TensorList parts,
    int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens, const std::string& group_name,
    c10::IntArrayRef group_options) {
  const Group group = group_of_op(group_name, group_options);
  const auto d = detail::gather_projected_backward_kernel(
      grad, y, weight, parts.vec(), sharding_of(q_heads, kv_heads, seq_lens, "BSHD", group.size()),
      group);
  return {d[0], d[1]};
}

std::vector<at::Tensor> gather_projected_autograd(const at::Tensor& y, const at::Tensor& weight,
                                                  int64_t q_heads, int64_t kv_heads,
                                                  c10::IntArrayRef seq_lens,
                                                  const std::string& group_name,
                                                  c10::IntArrayRef group_options, bool agree) {
  static const auto op = op_handle<decltype(gather_projected_op)>("ulysses::gather_projected");
  static const auto backward =
      op_handle<decltype(gather_projected_backward_op)>("ulysses::gather_projected_backward");
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

// ---- project_head_parts / project_from_head_parts (composite: traced through) ----------------

// Head ranges as the ops carry them: [begin_0, end_0, begin_1, end_1, ...].
std::vector<Range> ranges_of(c10::IntArrayRef flat) {
  TORCH_CHECK_VALUE(flat.size() % 2 == 0, "ulysses: head ranges come as [begin, end] pairs; got ",
                    flat.size(), " values");
  std::vector<Range> ranges;
  for (size_t i = 0; i < flat.size(); i += 2) ranges.push_back({flat[i], flat[i + 1]});
  return ranges;
}

std::vector<at::Tensor> project_head_parts_op(const at::Tensor& x, const at::Tensor& weight,
                                              const OptTensor& bias, c10::IntArrayRef ranges) {
  return project_head_parts(x, weight, bias, ranges_of(ranges));
}

at::Tensor project_from_head_parts_op(at::TensorList parts, const at::Tensor& weight,
                                      c10::IntArrayRef ranges) {
  return project_from_head_parts(parts.vec(), weight, ranges_of(ranges));
}

}  // namespace

namespace detail {

std::vector<at::Tensor> call_scatter_projected(const at::Tensor& x,
                                               const std::vector<HeadProjection>& projections,
                                               const Sharding& sharding, const Group& group) {
  static const auto op = op_handle<decltype(scatter_projected_op)>("ulysses::scatter_projected");
  std::vector<at::Tensor> weights;
  std::vector<std::string> heads;
  OptTensors biases;
  for (const HeadProjection& p : projections) {
    weights.push_back(p.weight);
    biases.push_back(p.bias);
    heads.push_back(heads_arg(p.heads));
  }
  return op.call(x, weights, biases, heads, sharding.heads.q_heads(), sharding.heads.kv_heads(),
                 sharding.seq.lengths(), op_group_name(group), options_to_ints(group.options()),
                 /*agree=*/false);
}

at::Tensor call_gather_projected(const at::Tensor& y, const at::Tensor& weight,
                                 const Sharding& sharding, const Group& group) {
  static const auto op = op_handle<decltype(gather_projected_op)>("ulysses::gather_projected");
  return op.call(y, weight, sharding.heads.q_heads(), sharding.heads.kv_heads(),
                 sharding.seq.lengths(), op_group_name(group), options_to_ints(group.options()),
                 /*agree=*/false)[0];
}

}  // namespace detail

TORCH_LIBRARY_FRAGMENT(ulysses, m) {
  const std::vector<at::Tag> pt2{at::Tag::pt2_compliant_tag};
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
}

// Collectives: one kernel for every device (the ProcessGroup dispatches by device).
TORCH_LIBRARY_IMPL(ulysses, CompositeExplicitAutograd, m) {
  m.impl("scatter_projected", &scatter_projected_op);
  m.impl("scatter_projected_backward", &scatter_projected_backward_op);
  m.impl("gather_projected", &gather_projected_op);
  m.impl("gather_projected_backward", &gather_projected_backward_op);
}

// The projections that make and take head parts (all_to_all.h): composite, so autograd and
// torch.compile go through their aten ops. ranges: [begin, end] per rank, flattened.
TORCH_LIBRARY_FRAGMENT(ulysses, m) {
  const std::vector<at::Tag> pt2{at::Tag::pt2_compliant_tag};
  m.def("project_head_parts(Tensor x, Tensor weight, Tensor? bias, int[] ranges) -> Tensor[]", pt2);
  m.def("project_from_head_parts(Tensor[] parts, Tensor weight, int[] ranges) -> Tensor", pt2);
}

TORCH_LIBRARY_IMPL(ulysses, CompositeImplicitAutograd, m) {
  m.impl("project_head_parts", &project_head_parts_op);
  m.impl("project_from_head_parts", &project_from_head_parts_op);
}

TORCH_LIBRARY_IMPL(ulysses, Autograd, m) {
  m.impl("scatter_projected", &scatter_projected_autograd);
  m.impl("gather_projected", &gather_projected_autograd);
}

}  // namespace ulysses
