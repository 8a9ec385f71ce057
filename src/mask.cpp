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
at::Tensor wire(const at::Tensor& t) { return t.scalar_type() == at::kBool ? t.view(at::kByte) : t; }

// The 4-D view of a 2-D [Sq, Sk] or 3-D [H, Sq, Sk] mask.
at::Tensor as_4d(const at::Tensor& mask) {
  if (mask.dim() == 2) return mask.unsqueeze(0).unsqueeze(0);
  if (mask.dim() == 3) return mask.unsqueeze(0);
  return mask;
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
                      "rebuild_mask: ranks disagree on ", name, "'s shape: ", describe(0),
                      " but ", describe(r));
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

at::Tensor all_gather_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group) {
  dim = wrap_dim(dim, x.dim());
  TORCH_CHECK_VALUE(x.size(dim) == seq.length(group.rank()), "all_gather_sequence: dim ", dim,
                    " of shape ", x.sizes(), " must be this rank's ", seq.length(group.rank()),
                    " tokens (rank ", group.rank(), " of ", group.size(), ")");
  if (group.size() == 1) return x;
  std::vector<at::Tensor> outs;
  {
    at::NoGradGuard no_grad;
    outs.push_back(gather_impl(x, dim, seq, group));
  }
  detail::attach_backward({x}, outs, "AllGatherSequenceBackward",
                          [dim, seq, group](std::vector<at::Tensor>&& g) {
                            return std::vector<at::Tensor>{
                                reduce_scatter_impl(g[0], dim, seq, group)};
                          });
  return outs[0];
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                   const Group& group) {
  dim = wrap_dim(dim, x.dim());
  TORCH_CHECK_VALUE(x.size(dim) == seq.seq_len(), "reduce_scatter_sequence: dim ", dim,
                    " of shape ", x.sizes(), " must hold all ", seq.seq_len(), " tokens");
  if (group.size() == 1) return x;
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

at::Tensor rebuild_mask(const at::Tensor& mask, const AllToAllPlan& plan, const Group& group,
                        const std::string& name) {
  if (group.size() == 1) return mask;
  const int P = group.size(), me = group.rank();
  const int64_t Hq = plan.heads.q_heads();
  auto all = group.agree(
      [&] {
        TORCH_CHECK_VALUE(mask.dim() >= 2 && mask.dim() <= 4, "rebuild_mask: ", name,
                          " must be 2-D [Sq, Sk], 3-D [heads, Sq, Sk] or 4-D [B, heads, Sq, Sk]; "
                          "got shape ",
                          mask.sizes(), " (rank ", me, " of ", P, ")");
        TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool || mask.is_floating_point(),
                         "rebuild_mask: ", name, " must be bool or floating point; got ",
                         mask.scalar_type());
        auto s = as_4d(mask).sizes();
        return std::vector<int64_t>{s[0], s[1], s[2], s[3]};
      },
      4);
  std::vector<std::array<int64_t, 4>> sizes;
  for (const auto& m : all) sizes.push_back({m[0], m[1], m[2], m[3]});
  const MaskDecision d = decide_mask(sizes, Hq, plan.seq, name);
  const at::Tensor m4 = as_4d(mask);
  if (d.heads == MaskHeads::kShared) {
    return d.rows == MaskRows::kSharded ? all_gather_sequence(m4, 2, plan.seq, group) : m4;
  }
  if (d.rows != MaskRows::kSharded) {
    const Range r = plan.heads.q_range(me);
    return m4.narrow(1, r.begin, r.size());
  }
  // Per-head query-sharded mask: [Bm, Hq, S_r, Sk] is a BHSD tensor with "head dim" Sk.
  AllToAllPlan bhsd = plan;
  bhsd.layout = Layout::kBHSD;
  if (m4.scalar_type() == at::kBool) {
    return scatter_heads(m4.view(at::kByte), Heads::kQuery, bhsd, group).view(at::kBool);
  }
  return scatter_heads(m4, Heads::kQuery, bhsd, group);
}

}  // namespace ulysses
