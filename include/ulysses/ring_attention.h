// Ring attention and the hybrid Ulysses x ring layout.
//
// SP = U x R ranks; SP rank p = r * U + u. The U consecutive ranks of a Ulysses group swap
// sequence for heads with all-to-alls; the R ranks of a ring group (stride U, same u, so the
// same heads) pass key/value blocks around: at step t ring rank r attends to the block of ring
// rank (r - t) mod R while the next block moves, and merges the partial results by their row
// log-sum-exp. Backward passes the blocks again with their dk/dv accumulators, which end at
// their owners after R transfers.
//
// Zigzag layout: the S tokens are cut evenly into 2R chunks; ring rank r holds chunks r and
// 2R-1-r, so under a causal mask every ring rank has the same work. A ring rank's tokens are
// split evenly over its U Ulysses ranks. R = 1 is the plain contiguous Ulysses layout.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

#include "ulysses/all_to_all.h"
#include "ulysses/attention.h"
#include "ulysses/flash_attention.h"
#include "ulysses/group.h"
#include "ulysses/mesh_plan.h"
#include "ulysses/partition.h"

namespace ulysses {

// Where every token of a sequence lives under the zigzag hybrid layout. A value.
class RingLayout {
 public:
  // The layout of `seq_len` (>= 0) tokens over `ulysses` x `ring` ranks (each >= 1).
  static RingLayout make(int64_t seq_len, int64_t ulysses, int64_t ring);

  int64_t seq_len() const { return chunks_.seq_len(); }
  int64_t ulysses() const { return ulysses_; }
  int64_t ring() const { return ring_; }
  int64_t sp_size() const { return ulysses_ * ring_; }
  // Tokens of ring rank r (all its Ulysses ranks together), and their global indices in
  // increasing order: chunk r, then chunk 2R-1-r.
  int64_t ring_length(int64_t r) const;
  std::vector<int64_t> ring_lengths() const;  // Of every ring rank.
  at::Tensor ring_index(int64_t r) const;
  // Global indices of SP rank p's tokens (its input shard), increasing.
  at::Tensor shard_index(int64_t p) const;
  // SP rank p's shard of `full` along `dim`, and the full tensor from every rank's shard.
  at::Tensor shard(const at::Tensor& full, int64_t dim, int64_t p) const;
  at::Tensor unshard(const std::vector<at::Tensor>& shards, int64_t dim) const;

 private:
  RingLayout(SequencePartition chunks, int64_t ulysses, int64_t ring)
      : chunks_(std::move(chunks)), ulysses_(ulysses), ring_(ring) {}
  SequencePartition chunks_;  // The 2R zigzag chunks.
  int64_t ulysses_ = 1, ring_ = 1;
};

// Attention of this ring rank's queries over the keys of every ring rank: `args` holds q, k, v
// of ring rank `ring.rank()`'s tokens in `layout`'s order (BHSD, this rank's heads; the same
// kv heads on every ring rank), kv_map, causal, scale and optionally a mask (bool or additive,
// [B or 1, heads or 1, Sq or 1, S or 1]: this rank's query rows, every key in global order;
// each step reads the columns of the block at hand); no positions or rows. `docs` ([B or 1, S]
// global document ids of packed sequences, see document_ids) or undefined. Differentiable in
// q, k, v and a float mask. CPU tensors (the fused kernel gives the log-sum-exp).
at::Tensor ring_attention(const LocalAttentionArgs& args, const RingLayout& layout,
                          const at::Tensor& docs, const Group& ring);

// The two passes of ring_attention without autograd (for the dispatcher op): out in q's
// dtype and lse [B, Hq, Sq] (fp32); and {dq, dk, dv, dmask} given grad_out and the forward's
// out, lse (dmask, in the mask's shape, only if `mask_grad`).
std::tuple<at::Tensor, at::Tensor> ring_attention_forward(const LocalAttentionArgs& args,
                                                          const RingLayout& layout,
                                                          const at::Tensor& docs,
                                                          const Group& ring);
std::vector<at::Tensor> ring_attention_backward(const at::Tensor& grad_out,
                                                const LocalAttentionArgs& args,
                                                const RingLayout& layout, const at::Tensor& docs,
                                                const Group& ring, const at::Tensor& out,
                                                const at::Tensor& lse, bool mask_grad = false);

// A mask given to hybrid attention on SP rank `sp_rank` (rows: its shard's, all S or 1; heads:
// 1 or Hq; keys: all S in global order or 1), made ready for ring_attention: rows of this ring
// rank's queries (full rows cut to the shard, then gathered over the Ulysses group by
// rebuild_mask's rules), this rank's heads, keys unchanged. `sharding` is the Ulysses group's.
at::Tensor rebuild_ring_mask(const at::Tensor& mask, const Sharding& sharding,
                             const RingLayout& layout, int64_t sp_rank, const Group& ulysses);

// Global document ids [B or 1, S] of packed sequences from this ring rank's position ids
// ([B, L] or [L], its tokens in `layout`'s order): one all-gather over the ring group.
at::Tensor ring_document_ids(const at::Tensor& positions, const RingLayout& layout,
                             const Group& ring);

}  // namespace ulysses
