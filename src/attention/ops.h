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

// rebuild_mask without autograd.
at::Tensor rebuild_mask_kernel(const at::Tensor& mask, const Sharding& sharding, const Group& group,
                               int64_t key_len);

}  // namespace ulysses::detail
