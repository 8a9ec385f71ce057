// Attention masks under sequence parallelism: rebuilt before local attention.
//
// The rules (which mask is gathered, split or kept) are decided in ulysses/mask_decision.h.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <string>
#include <vector>

#include "ulysses/all_to_all.h"
#include "ulysses/group.h"
#include "ulysses/mask_decision.h"
#include "ulysses/partition.h"

namespace ulysses {

// The 4-D view [Bm, Hm, Sq, Sk] of a 2-D [Sq, Sk], 3-D [heads, Sq, Sk] or 4-D mask.
at::Tensor as_4d_mask(const at::Tensor& mask);

// The gradient of a mask of `mask_sizes` given `grad`, the gradient of its rebuilt form (the
// adjoint of rebuild_mask: reduce-scatter, the reverse all-to-all, or zero-padding of this
// rank's head block). Agrees on the mask's shape with the other ranks like rebuild_mask.
at::Tensor rebuild_mask_backward(const at::Tensor& grad, const std::vector<int64_t>& mask_sizes,
                                 const Sharding& sharding, const Group& group,
                                 int64_t key_len = -1);

// Rebuilds `mask` (2-, 3- or 4-D, bool or float) for local attention on this rank's heads over
// the full sequence, following the rules above. Differentiable for float masks. Returns a 4-D
// mask broadcastable to [B, |R_r|, S, S] (or `mask` itself when P == 1). `key_len`: the keys
// the mask covers, -1 for S (see decide_mask).
at::Tensor rebuild_mask(const at::Tensor& mask, const Sharding& sharding, const Group& group,
                        int64_t key_len = -1);

}  // namespace ulysses
