// A faithful libtorch re-implementation of the reference system's (DeepSpeed Ulysses) all-to-all
// chain, for side-by-side benchmarks only: BSHD (batch_dim_idx = 0), its even path
// (reshape -> contiguous -> permute -> contiguous -> all_to_all_single -> permute -> contiguous
// -> reshape) and its uneven-head path (transpose / flatten, uneven splits, then split, permute
// and cat). Not used by the library.
#pragma once

#include <ATen/ATen.h>

#include "ulysses/group.h"

namespace ulysses::bench {

// [B, S/P, H, D] -> [B, S, H_r, D] (DeepSpeed scatter_idx=2, gather_idx=1).
at::Tensor reference_scatter_heads(const at::Tensor& x, const Group& group);
// [B, S, H_r, D] -> [B, S/P, H, D] (scatter_idx=1, gather_idx=2); `total_heads` is H.
at::Tensor reference_gather_heads(const at::Tensor& y, int64_t total_heads, const Group& group);

}  // namespace ulysses::bench
