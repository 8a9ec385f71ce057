// The mask decision: how a mask's query rows and heads are held across the ranks, and the
// shape its rebuilt form takes. Pure functions of shapes (no tensors, no collectives): the
// tensor code in ulysses/mask.h executes these decisions.
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

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "ulysses/attention_rules.h"
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
// `key_len`: the keys a mask covers; -1 means S (hybrid attention passes the global length,
// its queries being a ring rank's share of it).
MaskDecision decide_mask(const std::vector<std::array<int64_t, 4>>& sizes, int64_t q_heads,
                         const SequencePartition& seq, const std::string& name = "mask",
                         int64_t key_len = -1);

// Every rank's mask sizes checked against the rules above, at any P (P == 1 included), with
// the batch dim 1 or `batch`. Throws c10::ValueError like decide_mask.
void check_mask_shapes(const std::vector<std::array<int64_t, 4>>& sizes, int64_t batch,
                       int64_t q_heads, const SequencePartition& seq,
                       const std::string& name = "mask", int64_t key_len = -1);
// True when a mask of `sizes` (2-4 dims) is one mask for every head (no head dim, or 1): its
// rebuilt form does not depend on the head split, so layers with other heads can share it.
bool mask_shared_across_heads(const std::vector<int64_t>& sizes);
// The 4-D sizes [Bm, Hm, Sq, Sk] of a 2-D [Sq, Sk], 3-D [heads, Sq, Sk] or 4-D mask's sizes.
// Throws c10::ValueError naming `name` for any other number of dims.
std::array<int64_t, 4> mask_sizes_4d(const std::vector<int64_t>& sizes, const std::string& name);

// The 4-D shape rebuild_mask returns on `rank` for a mask of `sizes` (2-4 dims) on that rank,
// assuming every rank holds its mask the same way (sharded, full or broadcast rows): what a
// compiler needs before any rank's shapes are known. One row on a rank holding one token is
// read as broadcast (unless every rank holds one token). Throws like decide_mask.
std::vector<int64_t> rebuilt_mask_shape(const std::vector<int64_t>& sizes,
                                        const HeadPartition& heads, const SequencePartition& seq,
                                        int64_t rank, int64_t key_len = -1);

}  // namespace ulysses
