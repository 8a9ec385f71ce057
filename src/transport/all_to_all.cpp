#include "ulysses/all_to_all.h"

#include <c10/util/Exception.h>

#include "transport/agreement.h"
#include "transport/exchange.h"
#include "transport/exchange_blocks.h"
#include "transport/head_parts.h"
#include "transport/ops.h"

namespace ulysses {
namespace {

using detail::shape_str;

// The sequence -> heads exchange of `xs` on this rank (elements per (token, head) read from
// the tensors).
ExchangePlan seq_to_heads_plan(const std::vector<at::Tensor>& xs,
                               const std::vector<Heads>& tensor_heads, const Sharding& sharding,
                               const Group& group) {
  std::vector<int64_t> elements;
  for (const at::Tensor& x : xs) {
    elements.push_back(c10::multiply_integers(shape_with(x.sizes(), sharding.layout, 1, 1)));
  }
  return ExchangePlan::seq_to_heads(sharding.heads, sharding.seq, group.rank(), tensor_heads,
                                    elements);
}

// How the tensors a check reads are sharded: by sequence (before scatter_heads) or by heads.
enum class ShardedBy { kSequence, kHeads };

// Checks that `xs` match the agreed sharding on this rank.
void check_against_sharding(const char* op, const std::vector<at::Tensor>& xs,
                            const std::vector<Heads>& tensor_heads, const Sharding& sharding,
                            const Group& group, ShardedBy by) {
  TORCH_CHECK_VALUE(!xs.empty() && xs.size() == tensor_heads.size(), op,
                    ": need one Heads kind per tensor; got ", xs.size(), " tensors and ",
                    tensor_heads.size(), " tensor_heads");
  TORCH_CHECK_VALUE(sharding.heads.sp_size() == group.size(), op, ": sharding is for ",
                    sharding.heads.sp_size(), " ranks but the group has ", group.size());
  const int me = group.rank();
  const int64_t sdim = seq_dim(sharding.layout), hdim = head_dim(sharding.layout);
  for (size_t t = 0; t < xs.size(); ++t) {
    const at::Tensor& x = xs[t];
    TORCH_CHECK_VALUE(x.dim() == 4, op, ": tensor ", t, " must be 4-D (",
                      to_string(sharding.layout), "); got shape ", shape_str(x.sizes()), " (rank ",
                      me, ")");
    TORCH_CHECK_TYPE(x.scalar_type() == xs[0].scalar_type(), op,
                     ": fused tensors must share a dtype; got ", x.scalar_type(), " and ",
                     xs[0].scalar_type());
    const bool seq_sharded = by == ShardedBy::kSequence;
    const int64_t want_s = seq_sharded ? sharding.seq.length(me) : sharding.seq.seq_len();
    const int64_t want_h =
        seq_sharded ? sharding.total(tensor_heads[t]) : sharding.ranges(tensor_heads[t])[me].size();
    TORCH_CHECK_VALUE(x.size(sdim) == want_s && x.size(hdim) == want_h, op, ": tensor ", t,
                      " must have ", want_s, " tokens in dim ", sdim, " and ", want_h, " ",
                      heads_word(tensor_heads[t]), " heads in dim ", hdim, " (layout ",
                      to_string(sharding.layout), "); got shape ", shape_str(x.sizes()), " (rank ",
                      me, " of ", group.size(), ")");
  }
}

}  // namespace

namespace detail {

std::vector<at::Tensor> scatter_heads_kernel(const std::vector<at::Tensor>& xs,
                                             const std::vector<Heads>& tensor_heads,
                                             const Sharding& sharding, const Group& group) {
  check_against_sharding("scatter_heads", xs, tensor_heads, sharding, group, ShardedBy::kSequence);
  if (group.size() == 1) return xs;
  at::NoGradGuard no_grad;
  return exchange(xs, HeadForm::kWhole, seq_to_heads_plan(xs, tensor_heads, sharding, group),
                  sharding.layout, HeadForm::kWhole, group);
}

std::vector<at::Tensor> gather_heads_kernel(const std::vector<at::Tensor>& ys,
                                            const std::vector<Heads>& tensor_heads,
                                            const Sharding& sharding, const Group& group,
                                            HeadForm out) {
  check_against_sharding(out == HeadForm::kParts ? "gather_head_parts" : "gather_heads", ys,
                         tensor_heads, sharding, group, ShardedBy::kHeads);
  if (group.size() == 1) {
    if (out == HeadForm::kWhole) return ys;
    std::vector<at::Tensor> parts;  // One part per rank: the tensor itself.
    for (const at::Tensor& y : ys) parts.push_back(y);
    return parts;
  }
  at::NoGradGuard no_grad;
  return exchange(ys, HeadForm::kWhole,
                  seq_to_heads_plan(ys, tensor_heads, sharding, group).reversed(), sharding.layout,
                  out, group);
}

std::vector<at::Tensor> scatter_head_parts_kernel(const std::vector<std::vector<at::Tensor>>& parts,
                                                  const std::vector<Heads>& tensor_heads,
                                                  const Sharding& sharding, const Group& group) {
  TORCH_CHECK_VALUE(!parts.empty() && parts.size() == tensor_heads.size(),
                    "scatter_head_parts: need one Heads kind per tensor; got ", parts.size(),
                    " tensors and ", tensor_heads.size(), " tensor_heads");
  std::vector<at::Tensor> flat, firsts;
  for (size_t t = 0; t < parts.size(); ++t) {
    check_parts("scatter_head_parts", parts[t], tensor_heads[t], sharding, group);
    TORCH_CHECK_TYPE(parts[t][0].scalar_type() == parts[0][0].scalar_type(),
                     "scatter_head_parts: fused tensors must share a dtype; got ",
                     parts[t][0].scalar_type(), " and ", parts[0][0].scalar_type());
    flat.insert(flat.end(), parts[t].begin(), parts[t].end());
    firsts.push_back(parts[t][0]);
  }
  if (group.size() == 1) return firsts;
  at::NoGradGuard no_grad;
  return exchange(flat, HeadForm::kParts, seq_to_heads_plan(firsts, tensor_heads, sharding, group),
                  sharding.layout, HeadForm::kWhole, group);
}

}  // namespace detail

std::vector<at::Tensor> scatter_heads(const std::vector<at::Tensor>& xs,
                                      const std::vector<Heads>& tensor_heads,
                                      const Sharding& sharding, const Group& group) {
  check_against_sharding("scatter_heads", xs, tensor_heads, sharding, group, ShardedBy::kSequence);
  if (group.size() == 1) return xs;
  return detail::call_scatter_heads(xs, tensor_heads, sharding, group);
}

std::vector<at::Tensor> gather_heads(const std::vector<at::Tensor>& ys,
                                     const std::vector<Heads>& tensor_heads,
                                     const Sharding& sharding, const Group& group) {
  check_against_sharding("gather_heads", ys, tensor_heads, sharding, group, ShardedBy::kHeads);
  if (group.size() == 1) return ys;
  return detail::call_gather_heads(ys, tensor_heads, sharding, group, HeadForm::kWhole);
}

at::Tensor scatter_heads(const at::Tensor& x, Heads heads, const Sharding& sharding,
                         const Group& group) {
  return scatter_heads(std::vector<at::Tensor>{x}, {heads}, sharding, group)[0];
}

at::Tensor gather_heads(const at::Tensor& y, Heads heads, const Sharding& sharding,
                        const Group& group) {
  return gather_heads(std::vector<at::Tensor>{y}, {heads}, sharding, group)[0];
}

std::vector<at::Tensor> scatter_head_parts(const std::vector<std::vector<at::Tensor>>& parts,
                                           const std::vector<Heads>& tensor_heads,
                                           const Sharding& sharding, const Group& group) {
  if (group.size() == 1)
    return detail::scatter_head_parts_kernel(parts, tensor_heads, sharding, group);
  return detail::call_scatter_head_parts(parts, tensor_heads, sharding, group);
}

at::Tensor scatter_head_parts(const std::vector<at::Tensor>& parts, Heads heads,
                              const Sharding& sharding, const Group& group) {
  return scatter_head_parts(std::vector<std::vector<at::Tensor>>{parts}, {heads}, sharding,
                            group)[0];
}

std::vector<at::Tensor> gather_head_parts(const std::vector<at::Tensor>& ys,
                                          const std::vector<Heads>& tensor_heads,
                                          const Sharding& sharding, const Group& group) {
  check_against_sharding("gather_head_parts", ys, tensor_heads, sharding, group, ShardedBy::kHeads);
  if (group.size() == 1) return ys;
  return detail::call_gather_heads(ys, tensor_heads, sharding, group, HeadForm::kParts);
}

std::vector<at::Tensor> gather_head_parts(const at::Tensor& y, Heads heads,
                                          const Sharding& sharding, const Group& group) {
  return gather_head_parts(std::vector<at::Tensor>{y}, {heads}, sharding, group);
}

at::Tensor scatter_heads(const at::Tensor& x, const HeadPartition& partition, Heads heads,
                         Layout layout, const Group& group) {
  auto sharding = agree_plan(group, partition, layout, {TensorSpec{x, heads, "x"}});
  return scatter_heads(x, heads, sharding, group);
}

}  // namespace ulysses
