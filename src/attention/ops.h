// The attention floor's dispatcher ops (registered in attention/ops.cpp; Note [One autograd]
// in transport/ops.h): the library's calls into rebuild_mask and ring_attention, and the
// kernel rebuild_mask runs.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "ulysses/all_to_all.h"
#include "ulysses/attention.h"
#include "ulysses/group.h"
#include "ulysses/ring_attention.h"

namespace ulysses::detail {

at::Tensor call_rebuild_mask(const at::Tensor& mask, const Sharding& sharding, const Group& group,
                             int64_t key_len);
std::tuple<at::Tensor, at::Tensor> call_ring_attention(const LocalAttentionArgs& args,
                                                       const RingLayout& layout,
                                                       const at::Tensor& docs, const Group& ring);

// ring_attention_backward given delta = attention_delta(grad_out, out) [B, Hq, Sq] (fp32) in
// place of the forward's out, its only use there.
std::vector<at::Tensor> ring_backward_from_delta(const at::Tensor& grad_out,
                                                 const LocalAttentionArgs& args,
                                                 const RingLayout& layout, const at::Tensor& docs,
                                                 const Group& ring, const at::Tensor& delta,
                                                 const at::Tensor& lse, bool mask_grad);

// rebuild_mask without autograd.
at::Tensor rebuild_mask_kernel(const at::Tensor& mask, const Sharding& sharding, const Group& group,
                               int64_t key_len);

}  // namespace ulysses::detail
