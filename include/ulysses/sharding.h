// Sequence-sharded training: the data adapter, the exact global loss and gradient reduction.
// The one home of these rules: the C++ main job calls them directly and Python (ulysses.hf,
// ulysses.all_reduce_gradients) through the ops shard_batch, sharded_cross_entropy and
// all_reduce_gradients.
//
// Next-token targets are made on the global sequence, before sharding:
//   target[b, i] = labels[b, i + 1] (i < S - 1),  target[b, S - 1] = ignore_index,
// and, with a padding mask, target[b, i] = ignore_index where token i or i + 1 is padding (a
// padding target is no label; a padding input has no context). So the last token of shard r
// keeps its target, the first token of shard r + 1. Then rank r takes its tokens of input ids,
// targets, position ids and padding mask: [o_r, o_r + S_r) in Ulysses' contiguous split, or
// its zigzag tokens in a hybrid Ulysses x ring layout. The loss is the exact global token mean:
// sum over ranks of local CE sums / global count of non-ignored targets.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "ulysses/group.h"
#include "ulysses/partition.h"
#include "ulysses/ring_attention.h"

namespace ulysses {

constexpr int64_t kIgnoreIndex = -100;

// Token ids with labels, position ids and padding, [B, S] (global) or [B, S_r] (a shard).
struct TokenBatch {
  at::Tensor input_ids;       // int64.
  at::Tensor labels;          // int64; global: unshifted (undefined: input_ids); shard: targets.
  at::Tensor position_ids;    // int64; undefined in a global batch means 0..S-1.
  at::Tensor attention_mask;  // [B, S] nonzero at real tokens, zero at padding; or undefined.
};

// Makes next-token targets on the global batch, then cuts out `rank`'s shard of the sequence
// partition `seq`. The shard's labels are the targets.
TokenBatch shard_batch(const TokenBatch& global, const SequencePartition& seq, int64_t rank,
                       int64_t ignore_index = kIgnoreIndex);
// The same for SP rank `rank` of a hybrid Ulysses x ring layout (its zigzag tokens).
TokenBatch shard_batch(const TokenBatch& global, const RingLayout& layout, int64_t rank,
                       int64_t ignore_index = kIgnoreIndex);

// This rank's share of the exact global mean cross entropy, and the global values.
struct ShardedLoss {
  at::Tensor loss;           // Differentiable: local CE sum / global target count.
  double global_loss = 0;    // The mean over every target in the group.
  int64_t global_count = 0;  // Non-ignored targets in the group.
};

// logits [B, S_r, V], targets [B, S_r]. One small agreement round over `group`, which must span
// every rank whose targets share the mean (SP x DP): a rank whose inputs are wrong (shapes, a
// target outside [0, V)) fails every rank with its error. Summing every rank's gradients of
// `loss` gives the gradient of the global mean.
ShardedLoss sharded_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                  const Group& group, int64_t ignore_index = kIgnoreIndex);

// The same loss with the logits hidden [B, S_r, E] x weight^T ([V, E]) never materialised:
// linear_cross_entropy_sum (tiled.h) over `tiles` row tiles, which every rank should derive
// from the same agreed sizes.
ShardedLoss sharded_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                         const at::Tensor& targets, const Group& group,
                                         int64_t tiles, int64_t ignore_index = kIgnoreIndex);

// The same for a differentiable 0-d summed token loss computed elsewhere (e.g. a tiled loss in
// Python): token_sum / the group's target count, in the same one agreement round.
ShardedLoss token_mean(const at::Tensor& token_sum, const at::Tensor& targets, const Group& group,
                       int64_t ignore_index = kIgnoreIndex);

// Gradients are summed in buckets of at most this many bytes (DDP's default is 25 MiB): the
// step's extra memory is one bucket, not a flat copy of every gradient.
constexpr int64_t kGradientBucketBytes = 32 << 20;

// Sums `grads` over `group` in place. Small gradients of one (device, dtype) are coalesced into
// one all-reduce per bucket of `bucket_bytes`; a contiguous gradient of at least that size is
// summed where it lies. Every rank must pass the same list (gradients_of makes it so).
void all_reduce_gradients(const std::vector<at::Tensor>& grads, const Group& group,
                          int64_t bucket_bytes = kGradientBucketBytes);
// The gradients of `params` to sum over `group`, alike on every rank. Which parameters have a
// gradient may differ by rank (an expert no token of this shard chose, a vision tower that
// encoded no frame here): one small all-reduce finds those any rank has, this rank's missing
// ones are set to zeros, and a parameter no rank used keeps none (as unsharded). Without it the
// ranks' buckets would differ and the collectives mismatch. Every rank passes the same `params`
// (the model's parameter order).
std::vector<at::Tensor> gradients_of(const std::vector<at::Tensor>& params, const Group& group);

}  // namespace ulysses
