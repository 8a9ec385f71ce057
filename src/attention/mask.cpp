#include "ulysses/mask.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "attention/ops.h"
#include "transport/ops.h"

namespace ulysses {

at::Tensor as_4d_mask(const at::Tensor& mask) {
  if (mask.dim() == 2) return mask.unsqueeze(0).unsqueeze(0);
  if (mask.dim() == 3) return mask.unsqueeze(0);
  return mask;
}

namespace {

// Every rank's 4-D mask sizes, agreed in one small collective, and the decision they imply.
MaskDecision agree_mask(const std::vector<int64_t>& mask_sizes, const c10::ScalarType dtype,
                        bool requires_grad, const Sharding& sharding, const Group& group,
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
  return decide_mask(sizes, sharding.heads.q_heads(), sharding.seq, name, key_len);
}

// Per-head query-sharded masks move like Q: [Bm, Hq, S_r, Sk] is a BHSD tensor with "head
// dim" Sk.
Sharding mask_plan(const Sharding& sharding) {
  Sharding bhsd = sharding;
  bhsd.layout = Layout::kBHSD;
  return bhsd;
}

}  // namespace

at::Tensor rebuild_mask_backward(const at::Tensor& grad, const std::vector<int64_t>& mask_sizes,
                                 const Sharding& sharding, const Group& group, int64_t key_len) {
  if (group.size() == 1) return grad.reshape(mask_sizes);
  const MaskDecision d =
      agree_mask(mask_sizes, grad.scalar_type(), false, sharding, group, "mask", key_len);
  const auto s = mask_sizes_4d(mask_sizes, "mask");
  at::Tensor g;
  if (d.heads == MaskHeads::kShared) {
    g = d.rows == MaskRows::kSharded
            ? detail::sequence_collective_kernel(grad, 2, sharding.seq, group,
                                                 detail::SequenceCollective::kReduceScatter,
                                                 detail::ShapeAgreement::kAgreed)
            : grad;
  } else if (d.rows != MaskRows::kSharded) {
    const Range r = sharding.heads.q_range(group.rank());
    g = at::zeros({s[0], s[1], s[2], s[3]}, grad.options());
    g.narrow(1, r.begin, r.size()).copy_(grad);
  } else {
    g = detail::gather_heads_kernel({grad}, {Heads::kQuery}, mask_plan(sharding), group,
                                    HeadForm::kWhole)[0];
  }
  return g.reshape(mask_sizes);
}

at::Tensor rebuild_mask(const at::Tensor& mask, const Sharding& sharding, const Group& group,
                        int64_t key_len) {
  if (group.size() == 1) return mask;
  return detail::call_rebuild_mask(mask, sharding, group, key_len);
}

at::Tensor detail::rebuild_mask_kernel(const at::Tensor& mask, const Sharding& sharding,
                                       const Group& group, int64_t key_len) {
  if (group.size() == 1) return mask;
  at::NoGradGuard no_grad;
  const int me = group.rank();
  const MaskDecision d = agree_mask(mask.sizes().vec(), mask.scalar_type(), mask.requires_grad(),
                                    sharding, group, "mask", key_len);
  const at::Tensor m4 = as_4d_mask(mask);
  if (d.heads == MaskHeads::kShared) {
    // The agreement above covered the mask's shape and dtype on every rank.
    return d.rows == MaskRows::kSharded
               ? detail::sequence_collective_kernel(m4, 2, sharding.seq, group,
                                                    detail::SequenceCollective::kAllGather,
                                                    detail::ShapeAgreement::kAgreed)
               : m4;
  }
  if (d.rows != MaskRows::kSharded) {
    const Range r = sharding.heads.q_range(me);
    return m4.narrow(1, r.begin, r.size());
  }
  const Sharding bhsd = mask_plan(sharding);
  const bool flag = m4.scalar_type() == at::kBool;
  const at::Tensor moved = detail::scatter_heads_kernel({flag ? m4.view(at::kByte) : m4},
                                                        {Heads::kQuery}, bhsd, group)[0];
  return flag ? moved.view(at::kBool) : moved;
}

}  // namespace ulysses
