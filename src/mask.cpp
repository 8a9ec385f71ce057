#include "ulysses/mask.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "detail/autograd.h"

namespace ulysses {
namespace {

std::string sizes_str(const std::array<int64_t, 4>& s) {
  std::ostringstream os;
  os << "[" << s[0] << ", " << s[1] << ", " << s[2] << ", " << s[3] << "]";
  return os.str();
}

// Collectives move bytes: bool travels as uint8.
at::Tensor wire(const at::Tensor& t) {
  return t.scalar_type() == at::kBool ? t.view(at::kByte) : t;
}

std::array<int64_t, 4> sizes_4d(const std::vector<int64_t>& s, const std::string& name) {
  TORCH_CHECK_VALUE(s.size() >= 2 && s.size() <= 4, "rebuild_mask: ", name,
                    " must be 2-D [Sq, Sk], 3-D [heads, Sq, Sk] or 4-D [B, heads, Sq, Sk]; got "
                    "shape ",
                    c10::IntArrayRef(s));
  std::array<int64_t, 4> out{1, 1, 1, 1};
  std::copy(s.begin(), s.end(), out.begin() + (4 - s.size()));
  return out;
}

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
  at::Tensor all = group.all_gather(wire(padded));  // [P, s_max, ...]
  if (x.scalar_type() == at::kBool) all = all.view(at::kBool);
  std::vector<at::Tensor> parts;
  for (int r = 0; r < P; ++r) parts.push_back(all[r].narrow(0, 0, seq.length(r)));
  return at::cat(parts, 0).movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter_impl(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group) {
  const int P = group.size(), me = group.rank();
  at::Tensor front = x.movedim(dim, 0).contiguous();  // [S, rest...]: rank blocks contiguous.
  const int64_t rest = front.numel() / std::max<int64_t>(1, front.size(0));
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

MaskDecision decide_mask(const std::vector<std::array<int64_t, 4>>& sizes, int64_t q_heads,
                         const SequencePartition& seq, const std::string& name) {
  const int64_t P = seq.sp_size(), S = seq.seq_len();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(sizes.size()) == P && P > 1);
  auto describe = [&](int64_t r) {
    std::ostringstream os;
    os << name << " has shape " << sizes_str(sizes[r]) << " on rank " << r << " of " << P
       << " (S=" << S << ", S_r=" << seq.length(r) << ", Hq=" << q_heads << ")";
    return os.str();
  };
  const std::string accepted =
      "accepted: [B or 1, 1 or Hq, S_r or S or 1, S or 1] (2-D [Sq, Sk], 3-D [heads, Sq, Sk])";
  bool sharded = true, full = true, broadcast = true;
  for (int64_t r = 0; r < P; ++r) {
    const auto& s = sizes[r];
    TORCH_CHECK_VALUE(s[0] == sizes[0][0] && s[1] == sizes[0][1] && s[3] == sizes[0][3],
                      "rebuild_mask: ranks disagree on ", name, "'s shape: ", describe(0), " but ",
                      describe(r));
    TORCH_CHECK_VALUE(!(s[3] == seq.length(r) && s[3] != S && s[3] != 1),
                      "rebuild_mask: ", describe(r),
                      ": its key dim is sharded, and a key-sharded mask cannot be rebuilt from "
                      "local pieces; pass a mask over all S keys");
    TORCH_CHECK_VALUE(s[3] == S || s[3] == 1, "rebuild_mask: ", describe(r),
                      ": key dim must be S or 1; ", accepted);
    TORCH_CHECK_VALUE(s[1] == 1 || s[1] == q_heads, "rebuild_mask: ", describe(r),
                      ": head dim must be 1 or Hq; ", accepted);
    sharded = sharded && s[2] == seq.length(r);
    full = full && s[2] == S;
    broadcast = broadcast && s[2] == 1;
  }
  TORCH_CHECK_VALUE(sharded || full || broadcast, "rebuild_mask: ", name,
                    "'s query dim must be S_r on every rank, S, or 1; ", describe(0), "; ",
                    accepted);
  MaskDecision d;
  d.rows = sharded ? MaskRows::kSharded : full ? MaskRows::kFull : MaskRows::kBroadcast;
  d.heads = sizes[0][1] == 1 ? MaskHeads::kShared : MaskHeads::kPerHead;
  return d;
}

namespace {

// Checks `x` on every rank before a sequence collective along `dim` moves its bytes: the
// sequence dim holds `tokens` tokens on this rank, and every rank has the same number of dims,
// dtype and elements per token (so Gloo never sees mismatched sizes). Returns the wrapped dim.
int64_t agree_sequence_tensor(const char* op, const at::Tensor& x, int64_t dim, int64_t tokens,
                              const Group& group) {
  int64_t d = 0;
  auto all = group.agree([&] {
    TORCH_CHECK_INDEX(x.dim() > 0 && dim >= -x.dim() && dim < x.dim(), op, ": dim ", dim,
                      " is out of range for shape ", x.sizes());
    d = wrap_dim(dim, x.dim());
    TORCH_CHECK_VALUE(x.size(d) == tokens, op, ": dim ", d, " of shape ", x.sizes(), " must hold ",
                      tokens, " tokens");
    return std::vector<int64_t>{x.dim(), static_cast<int64_t>(x.scalar_type()), d,
                                x.numel() / std::max<int64_t>(1, x.size(d))};
  });
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

// all_gather_sequence once every rank's shapes are known to match.
at::Tensor gather_agreed(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                         const Group& group) {
  std::vector<at::Tensor> outs;
  {
    at::NoGradGuard no_grad;
    outs.push_back(gather_impl(x, dim, seq, group));
  }
  detail::attach_backward(
      {x}, outs, "AllGatherSequenceBackward", [dim, seq, group](std::vector<at::Tensor>&& g) {
        return std::vector<at::Tensor>{reduce_scatter_impl(g[0], dim, seq, group)};
      });
  return outs[0];
}

}  // namespace

at::Tensor all_gather_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group) {
  if (group.size() == 1) return x;
  dim = agree_sequence_tensor("all_gather_sequence", x, dim, seq.length(group.rank()), group);
  return gather_agreed(x, dim, seq, group);
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                   const Group& group) {
  if (group.size() == 1) return x;
  dim = agree_sequence_tensor("reduce_scatter_sequence", x, dim, seq.seq_len(), group);
  std::vector<at::Tensor> outs;
  {
    at::NoGradGuard no_grad;
    outs.push_back(reduce_scatter_impl(x, dim, seq, group));
  }
  detail::attach_backward({x}, outs, "ReduceScatterSequenceBackward",
                          [dim, seq, group](std::vector<at::Tensor>&& g) {
                            return std::vector<at::Tensor>{gather_impl(g[0], dim, seq, group)};
                          });
  return outs[0];
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
                        const std::string& name) {
  auto all = group.agree([&] {
    TORCH_CHECK_TYPE(dtype == at::kBool || c10::isFloatingType(dtype), "rebuild_mask: ", name,
                     " must be bool or floating point; got ", dtype);
    const auto s = sizes_4d(mask_sizes, name);
    return std::vector<int64_t>{
        s[0], s[1], s[2], s[3], static_cast<int64_t>(dtype), requires_grad ? 1 : 0};
  });
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
  return decide_mask(sizes, plan.heads.q_heads(), plan.seq, name);
}

// Per-head query-sharded masks move like Q: [Bm, Hq, S_r, Sk] is a BHSD tensor with "head
// dim" Sk.
AllToAllPlan mask_plan(const AllToAllPlan& plan) {
  AllToAllPlan bhsd = plan;
  bhsd.layout = Layout::kBHSD;
  return bhsd;
}

}  // namespace

std::vector<int64_t> rebuilt_mask_shape(const std::vector<int64_t>& sizes,
                                        const HeadPartition& heads, const SequencePartition& seq,
                                        int64_t rank) {
  auto s = sizes_4d(sizes, "mask");
  if (seq.sp_size() == 1) return {s[0], s[1], s[2], s[3]};
  std::vector<std::array<int64_t, 4>> all;
  for (int64_t r = 0; r < seq.sp_size(); ++r) {
    auto t = s;
    if (s[2] == seq.length(rank)) t[2] = seq.length(r);  // Sharded rows on every rank.
    all.push_back(t);
  }
  const MaskDecision d = decide_mask(all, heads.q_heads(), seq);
  const int64_t rows = d.rows == MaskRows::kSharded ? seq.seq_len() : s[2];
  const int64_t h = d.heads == MaskHeads::kShared ? 1 : heads.q_range(rank).size();
  return {s[0], h, rows, s[3]};
}

at::Tensor rebuild_mask_backward(const at::Tensor& grad, const std::vector<int64_t>& mask_sizes,
                                 const AllToAllPlan& plan, const Group& group) {
  if (group.size() == 1) return grad.reshape(mask_sizes);
  const MaskDecision d = agree_mask(mask_sizes, grad.scalar_type(), false, plan, group, "mask");
  const auto s = sizes_4d(mask_sizes, "mask");
  at::Tensor g;
  if (d.heads == MaskHeads::kShared) {
    g = d.rows == MaskRows::kSharded ? reduce_scatter_impl(grad, 2, plan.seq, group) : grad;
  } else if (d.rows != MaskRows::kSharded) {
    const Range r = plan.heads.q_range(group.rank());
    g = at::zeros({s[0], s[1], s[2], s[3]}, grad.options());
    g.narrow(1, r.begin, r.size()).copy_(grad);
  } else {
    g = gather_heads(grad, Heads::kQuery, mask_plan(plan), group);
  }
  return g.reshape(mask_sizes);
}

at::Tensor rebuild_mask(const at::Tensor& mask, const AllToAllPlan& plan, const Group& group,
                        const std::string& name) {
  if (group.size() == 1) return mask;
  const int me = group.rank();
  const MaskDecision d =
      agree_mask(mask.sizes().vec(), mask.scalar_type(), mask.requires_grad(), plan, group, name);
  const at::Tensor m4 = as_4d_mask(mask);
  if (d.heads == MaskHeads::kShared) {
    // The agreement above covered the mask's shape and dtype on every rank.
    return d.rows == MaskRows::kSharded ? gather_agreed(m4, 2, plan.seq, group) : m4;
  }
  if (d.rows != MaskRows::kSharded) {
    const Range r = plan.heads.q_range(me);
    return m4.narrow(1, r.begin, r.size());
  }
  const AllToAllPlan bhsd = mask_plan(plan);
  if (m4.scalar_type() == at::kBool) {
    return scatter_heads(m4.view(at::kByte), Heads::kQuery, bhsd, group).view(at::kBool);
  }
  return scatter_heads(m4, Heads::kQuery, bhsd, group);
}

}  // namespace ulysses
