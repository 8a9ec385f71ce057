// Attention masks under sequence parallelism: rebuilt before local attention.
//
// A mask is bool (true = attend) or additive float, broadcastable to [B, Hq, Sq, Sk]; 2-D masks
// are [Sq, Sk], 3-D masks [heads, Sq, Sk]. With 4-D sizes [Bm, Hm, Sq, Sk] on every rank,
// P ranks, S = sum_r S_r tokens and this rank's query heads R_r:
//   key dim:    Sk == S or Sk == 1; Sk == S_r != S is a key-sharded mask, an error.
//   query dim:  sharded (Sq_r == S_r on every rank), full (Sq == S) or broadcast (Sq == 1).
//   Hm == 1:    sharded -> all_gather_sequence along dim 2: [Bm, 1, S, Sk]; else unchanged.
//   Hm == Hq:   sharded -> all-to-all exactly like Q: [Bm, |R_r|, S, Sk];
//               else this rank's head block mask[:, R_r].
// P == 1 leaves a mask untouched. The decision uses every rank's shapes (agreed in one small
// collective), so all ranks take the same branch or raise the same error.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <string>
#include <vector>

#include "ulysses/all_to_all.h"
#include "ulysses/group.h"
#include "ulysses/partition.h"

namespace ulysses {

// How the query rows of a mask are held.
enum class MaskRows {
  kSharded,    // Sq == S_r: this rank's query rows only.
  kFull,       // Sq == S: every query row.
  kBroadcast,  // Sq == 1: one row for all queries.
};

// How the heads of a mask are held.
enum class MaskHeads {
  kShared,   // Hm == 1: one mask for every head.
  kPerHead,  // Hm == Hq: one mask per query head.
};

struct MaskDecision {
  MaskRows rows = MaskRows::kFull;
  MaskHeads heads = MaskHeads::kShared;
  bool operator==(const MaskDecision& o) const { return rows == o.rows && heads == o.heads; }
};

// The pure decision for a mask whose 4-D sizes on rank r are `sizes[r]` ([Bm, Hm, Sq, Sk]).
// Throws c10::ValueError naming `name`, the shapes and the accepted shapes. Requires P > 1.
MaskDecision decide_mask(const std::vector<std::array<int64_t, 4>>& sizes, int64_t q_heads,
                         const SequencePartition& seq, const std::string& name = "mask");

// Gathers the sequence shards of `x` along `dim` into the full sequence:
// [.., S_r, ..] -> [.., S, ..] in rank order. Backward: reduce_scatter_sequence.
at::Tensor all_gather_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group);
// Sums `x` ([.., S, ..] on every rank) over the group and keeps this rank's rows along `dim`:
// [.., S_r, ..]. Backward: all_gather_sequence.
at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                   const Group& group);

// The 4-D view [Bm, Hm, Sq, Sk] of a 2-D [Sq, Sk], 3-D [heads, Sq, Sk] or 4-D mask.
at::Tensor as_4d_mask(const at::Tensor& mask);

// The 4-D shape rebuild_mask returns on `rank` for a mask of `sizes` (2-4 dims) on that rank,
// assuming every rank holds its mask the same way (sharded, full or broadcast rows): what a
// compiler needs before any rank's shapes are known. Throws like decide_mask.
std::vector<int64_t> rebuilt_mask_shape(const std::vector<int64_t>& sizes,
                                        const HeadPartition& heads, const SequencePartition& seq,
                                        int64_t rank);

// The gradient of a mask of `mask_sizes` given `grad`, the gradient of its rebuilt form (the
// adjoint of rebuild_mask: reduce-scatter, the reverse all-to-all, or zero-padding of this
// rank's head block). Agrees on the mask's shape with the other ranks like rebuild_mask.
at::Tensor rebuild_mask_backward(const at::Tensor& grad, const std::vector<int64_t>& mask_sizes,
                                 const AllToAllPlan& plan, const Group& group);

// Rebuilds `mask` (2-, 3- or 4-D, bool or float) for local attention on this rank's heads over
// the full sequence, following the rules above. Differentiable for float masks. Returns a 4-D
// mask broadcastable to [B, |R_r|, S, S] (or `mask` itself when P == 1).
at::Tensor rebuild_mask(const at::Tensor& mask, const AllToAllPlan& plan, const Group& group,
                        const std::string& name = "mask");

}  // namespace ulysses
