#include "ulysses/mask.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "detail/ops.h"
#include "detail/wire.h"

namespace ulysses {
namespace {

at::Tensor gather_impl(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                       const Group& group) {
  const int P = group.size();
  int64_t s_max = 0;
  for (int64_t n : seq.lengths()) s_max = std::max(s_max, n);
  // Gloo's all-gather needs equal sizes: pad every shard to the longest.
  at::Tensor front = x.movedim(dim, 0);
  std::vector<int64_t> padded_shape = front.sizes().vec();
  padded_shape[0] = s_max;
  at::Tensor padded = at::zeros(padded_shape, x.options());
  padded.narrow(0, 0, front.size(0)).copy_(front);
  at::Tensor all = group.all_gather(detail::wire_view(padded)).view(x.scalar_type());
  std::vector<at::Tensor> parts;
  for (int r = 0; r < P; ++r) parts.push_back(all[r].narrow(0, 0, seq.length(r)));
  return at::cat(parts, 0).movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter_impl(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group) {
  const int P = group.size(), me = group.rank();
  at::Tensor front = x.movedim(dim, 0).contiguous();  // [S, rest...]: rank blocks contiguous.
  const int64_t rest = c10::multiply_integers(front.sizes().slice(1));
  std::vector<int64_t> send_splits, recv_splits;
  for (int r = 0; r < P; ++r) {
    send_splits.push_back(seq.length(r) * rest);
    recv_splits.push_back(seq.length(me) * rest);
  }
  at::Tensor send = front.view({-1});
  at::Tensor recv = at::empty({P * seq.length(me) * rest}, x.options());
  group.all_to_all(recv, send, recv_splits, send_splits);
  std::vector<int64_t> shape = front.sizes().vec();
  shape[0] = seq.length(me);
  shape.insert(shape.begin(), P);
  return recv.view(shape).sum(0).movedim(0, dim).contiguous();
}

int64_t wrap_dim(int64_t dim, int64_t ndim) { return dim < 0 ? dim + ndim : dim; }

}  // namespace

namespace {

// Checks `x` on every rank before a sequence collective along `dim` moves its bytes: the
// sequence dim holds `tokens` tokens on this rank, and every rank has the same number of dims,
// dtype and elements per token (so Gloo never sees mismatched sizes). Returns the wrapped dim.
int64_t agree_sequence_tensor(const char* op, const at::Tensor& x, int64_t dim, int64_t tokens,
                              const Group& group) {
  int64_t d = 0;
  auto all = group.agree(
      [&] {
        TORCH_CHECK_INDEX(x.dim() > 0 && dim >= -x.dim() && dim < x.dim(), op, ": dim ", dim,
                          " is out of range for shape ", x.sizes());
        d = wrap_dim(dim, x.dim());
        TORCH_CHECK_VALUE(x.size(d) == tokens, op, ": dim ", d, " of shape ", x.sizes(),
                          " must hold ", tokens, " tokens");
        int64_t per_token =
            1;  // From the shape: an empty shard (S_r = 0) has elements per token too.
        for (int64_t i = 0; i < x.dim(); ++i) per_token *= i == d ? 1 : x.size(i);
        return std::vector<int64_t>{x.dim(), static_cast<int64_t>(x.scalar_type()), d, per_token};
      },
      std::string("the sequence tensor (") + op + ")");
  const char* what[] = {"number of dims", "dtype (as c10::ScalarType)", "sequence dim",
                        "elements per token"};
  for (size_t r = 0; r < all.size(); ++r) {
    for (size_t i = 0; i < 4; ++i) {
      TORCH_CHECK_VALUE(all[r][i] == all[0][i], op, ": ranks disagree on the tensor's ", what[i],
                        ": rank 0 has ", all[0][i], ", rank ", r, " has ", all[r][i]);
    }
  }
  return d;
}

}  // namespace

namespace detail {

at::Tensor all_gather_sequence_kernel(const at::Tensor& x, int64_t dim,
                                      const SequencePartition& seq, const Group& group,
                                      bool agree) {
  if (group.size() == 1) return x;
  dim = agree
            ? agree_sequence_tensor("all_gather_sequence", x, dim, seq.length(group.rank()), group)
            : wrap_dim(dim, x.dim());
  at::NoGradGuard no_grad;
  return gather_impl(x, dim, seq, group);
}

at::Tensor reduce_scatter_sequence_kernel(const at::Tensor& x, int64_t dim,
                                          const SequencePartition& seq, const Group& group,
                                          bool agree) {
  if (group.size() == 1) return x;
  dim = agree ? agree_sequence_tensor("reduce_scatter_sequence", x, dim, seq.seq_len(), group)
              : wrap_dim(dim, x.dim());
  at::NoGradGuard no_grad;
  return reduce_scatter_impl(x, dim, seq, group);
}

}  // namespace detail

at::Tensor all_gather_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group) {
  if (group.size() == 1) return x;
  return detail::call_sequence_collective(x, dim, seq, group, /*reduce=*/false);
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                   const Group& group) {
  if (group.size() == 1) return x;
  return detail::call_sequence_collective(x, dim, seq, group, /*reduce=*/true);
}

at::Tensor as_4d_mask(const at::Tensor& mask) {
  if (mask.dim() == 2) return mask.unsqueeze(0).unsqueeze(0);
  if (mask.dim() == 3) return mask.unsqueeze(0);
  return mask;
}

namespace {

// Every rank's 4-D mask sizes, agreed in one small collective, and the decision they imply.
MaskDecision agree_mask(const std::vector<int64_t>& mask_sizes, const c10::ScalarType dtype,
                        bool requires_grad, const AllToAllPlan& plan, const Group& group,
                        const std::string& name, int64_t key_len) {
  auto all = group.agree(
      [&] {
        TORCH_CHECK_TYPE(dtype == at::kBool || c10::isFloatingType(dtype), "rebuild_mask: ", name,
                         " must be bool or floating point; got ", dtype);
        const auto s = mask_sizes_4d(mask_sizes, name);
        return std::vector<int64_t>{
            s[0], s[1], s[2], s[3], static_cast<int64_t>(dtype), requires_grad ? 1 : 0};
      },
      "the mask's shape (rebuild_mask)");
  std::vector<std::array<int64_t, 4>> sizes;
  for (size_t r = 0; r < all.size(); ++r) {
    const auto& m = all[r];
    // The bytes on the wire depend on the dtype, and whether a backward pass follows on the
    // gradient: ranks must hold both alike.
    TORCH_CHECK_TYPE(m[4] == all[0][4], "rebuild_mask: ranks disagree on ", name,
                     "'s dtype: rank 0 has ", static_cast<c10::ScalarType>(all[0][4]), ", rank ", r,
                     " has ", static_cast<c10::ScalarType>(m[4]));
    TORCH_CHECK_VALUE(m[5] == all[0][5], "rebuild_mask: ranks disagree on whether ", name,
                      " requires grad: rank 0 ", all[0][5] ? "does" : "does not", ", rank ", r,
                      m[5] ? " does" : " does not");
    sizes.push_back({m[0], m[1], m[2], m[3]});
  }
  return decide_mask(sizes, plan.heads.q_heads(), plan.seq, name, key_len);
}

// Per-head query-sharded masks move like Q: [Bm, Hq, S_r, Sk] is a BHSD tensor with "head
// dim" Sk.
AllToAllPlan mask_plan(const AllToAllPlan& plan) {
  AllToAllPlan bhsd = plan;
  bhsd.layout = Layout::kBHSD;
  return bhsd;
}

}  // namespace

at::Tensor rebuild_mask_backward(const at::Tensor& grad, const std::vector<int64_t>& mask_sizes,
                                 const AllToAllPlan& plan, const Group& group, int64_t key_len) {
  if (group.size() == 1) return grad.reshape(mask_sizes);
  const MaskDecision d =
      agree_mask(mask_sizes, grad.scalar_type(), false, plan, group, "mask", key_len);
  const auto s = mask_sizes_4d(mask_sizes, "mask");
  at::Tensor g;
  if (d.heads == MaskHeads::kShared) {
    g = d.rows == MaskRows::kSharded ? reduce_scatter_impl(grad, 2, plan.seq, group) : grad;
  } else if (d.rows != MaskRows::kSharded) {
    const Range r = plan.heads.q_range(group.rank());
    g = at::zeros({s[0], s[1], s[2], s[3]}, grad.options());
    g.narrow(1, r.begin, r.size()).copy_(grad);
  } else {
    g = detail::gather_heads_kernel({grad}, {Heads::kQuery}, mask_plan(plan), group, false)[0];
  }
  return g.reshape(mask_sizes);
}

at::Tensor rebuild_mask(const at::Tensor& mask, const AllToAllPlan& plan, const Group& group,
                        int64_t key_len) {
  if (group.size() == 1) return mask;
  return detail::call_rebuild_mask(mask, plan, group, key_len);
}

at::Tensor detail::rebuild_mask_kernel(const at::Tensor& mask, const AllToAllPlan& plan,
                                       const Group& group, int64_t key_len) {
  if (group.size() == 1) return mask;
  at::NoGradGuard no_grad;
  const int me = group.rank();
  const MaskDecision d = agree_mask(mask.sizes().vec(), mask.scalar_type(), mask.requires_grad(),
                                    plan, group, "mask", key_len);
  const at::Tensor m4 = as_4d_mask(mask);
  if (d.heads == MaskHeads::kShared) {
    // The agreement above covered the mask's shape and dtype on every rank.
    return d.rows == MaskRows::kSharded ? gather_impl(m4, 2, plan.seq, group) : m4;
  }
  if (d.rows != MaskRows::kSharded) {
    const Range r = plan.heads.q_range(me);
    return m4.narrow(1, r.begin, r.size());
  }
  const AllToAllPlan bhsd = mask_plan(plan);
  const bool flag = m4.scalar_type() == at::kBool;
  const at::Tensor moved = detail::scatter_heads_kernel({flag ? m4.view(at::kByte) : m4},
                                                        {Heads::kQuery}, bhsd, group)[0];
  return flag ? moved.view(at::kBool) : moved;
}

}  // namespace ulysses
