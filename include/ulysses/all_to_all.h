// Differentiable Ulysses all-to-alls between sequence sharding and head sharding.
//
// With P ranks, sequence partition S = sum_j S_j (rank j holds tokens [o_j, o_j + S_j)) and
// head ranges R_j = [h_j, h_j + H_j) from a HeadPartition, in any Layout (BSHD shown):
//   scatter_heads:  y_r[b, o_j + s, hl, d] = x_j[b, s, h_r + hl, d]       (seq -> heads)
//   gather_heads:   x_r[b, s, h_j + hl, d] = sum_j y_j[b, o_r + s, hl, d] (heads -> seq)
// The sum in gather_heads only has more than one term for kv heads that are replicated over
// ranks (Hkv < P); there it is exactly the backward of scatter_heads.
// Backward of each op is the other, using the Sharding saved with the autograd node: the
// total head count is never read from anywhere else. Q, K and V may move in one collective.
// Which block goes where is an ExchangePlan (ulysses/exchange_plan.h); this file executes it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

#include "ulysses/exchange_plan.h"
#include "ulysses/group.h"
#include "ulysses/partition.h"

namespace ulysses {

// One tensor to be checked by agree_plan: its role and its name for error messages.
struct TensorSpec {
  at::Tensor tensor;  // 4-D, sequence-sharded: [B, S_r, H, D] in BSHD.
  Heads heads = Heads::kQuery;
  std::string name = "x";
};

// How one call's tensors are sharded over the group, identical on every rank: tokens by rank
// before the exchange (seq), heads by rank after it (heads), in one layout. Everything the
// all-to-alls need; the ExchangePlan (who sends which block to whom) is derived from it.
struct Sharding {
  HeadPartition heads;
  SequencePartition seq;
  Layout layout = Layout::kBSHD;

  // The head ranges, one per rank, that tensors of kind `h` are split into.
  const std::vector<Range>& ranges(Heads h) const {
    return h == Heads::kQuery ? heads.q_ranges() : heads.kv_ranges();
  }
  int64_t total(Heads h) const { return h == Heads::kQuery ? heads.q_heads() : heads.kv_heads(); }
};

// Checks `tensors` on every rank and agrees on the sharding in one small collective: each must be a
// floating-point 4-D tensor in `layout` with all Hq (or Hkv) heads, one batch size, on one
// device, and every rank must hold the same head counts, layout, batch, head dims, dtypes,
// device types, the given `seq` (if any) and the group handle's exchange options
// (GroupOptions::pipeline_min_bytes, message_bytes, shared_memory, transport).
// Local sequence lengths are gathered (or checked against `seq` when given); a mask's shape is
// checked against every rank's (mask_decision.h). Any violation raises the same error on every
// rank before data moves, naming the argument and every rank's value.
Sharding agree_plan(const Group& group, const HeadPartition& heads, Layout layout,
                    const std::vector<TensorSpec>& tensors,
                    const c10::optional<SequencePartition>& seq = c10::nullopt);

// [S_r, all heads] -> [S, this rank's heads] (in `sharding.layout`). Differentiable.
at::Tensor scatter_heads(const at::Tensor& x, Heads heads, const Sharding& sharding,
                         const Group& group);
// [S, this rank's heads] -> [S_r, all heads]; replicated kv heads are summed. Differentiable.
at::Tensor gather_heads(const at::Tensor& y, Heads heads, const Sharding& sharding,
                        const Group& group);

// Fused forms: the tensors (e.g. Q, K, V) move in one collective. Same dtype required.
std::vector<at::Tensor> scatter_heads(const std::vector<at::Tensor>& xs,
                                      const std::vector<Heads>& heads, const Sharding& sharding,
                                      const Group& group);
std::vector<at::Tensor> gather_heads(const std::vector<at::Tensor>& ys,
                                     const std::vector<Heads>& heads, const Sharding& sharding,
                                     const Group& group);

// Heads split by rank ("parts"): parts[j] holds the heads R[j] of rank j, in `sharding.layout`
// ([B, S_r, |R[j]|, D] in BSHD before the scatter), one tensor per rank of the group, as a
// projection per destination makes them (project_head_parts). Exchanging parts needs no
// packing and no unpacking: each part is the message to its rank, each received block a part.
//
// scatter_heads from parts: equal to scatter_heads(cat(parts along the head dim)), without the
// cat (parts for replicated kv heads repeat them). Differentiable.
at::Tensor scatter_head_parts(const std::vector<at::Tensor>& parts, Heads heads,
                              const Sharding& sharding, const Group& group);
// Fused form: several tensors' parts (e.g. Q, K, V) in one exchange. Same dtype required.
std::vector<at::Tensor> scatter_head_parts(const std::vector<std::vector<at::Tensor>>& parts,
                                           const std::vector<Heads>& heads,
                                           const Sharding& sharding, const Group& group);
// gather_heads into parts: part j is rank j's heads R[j] on this rank's tokens. Replicated kv
// heads stay in their own parts (gather_heads sums them). Differentiable.
std::vector<at::Tensor> gather_head_parts(const at::Tensor& y, Heads heads,
                                          const Sharding& sharding, const Group& group);
// Fused form: the parts of every tensor, flattened: tensor t's part j at t * P + j.
std::vector<at::Tensor> gather_head_parts(const std::vector<at::Tensor>& ys,
                                          const std::vector<Heads>& heads, const Sharding& sharding,
                                          const Group& group);
// The projections that make and take parts (BSHD): one GEMM per rank instead of one in all,
// the same FLOPs. `ranges` are the head ranges by rank (Sharding::ranges).
// Input projection: part j = (x @ weight[rows of heads R[j]]^T + bias[same]) viewed
// [B, S_r, |R[j]|, D], for x [B, S_r, E] and weight [H x D, E] with head-major rows (a
// Linear's). Differentiable.
std::vector<at::Tensor> project_head_parts(const at::Tensor& x, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias,
                                           const std::vector<Range>& ranges);
// Output projection: sum_j parts[j] (flattened to [B, S_r, |R[j]| x D]) @ weight[:, columns of
// heads R[j]]^T, for weight [E, H x D]: a Linear of the whole gathered tensor, without
// assembling it. Differentiable.
at::Tensor project_from_head_parts(const std::vector<at::Tensor>& parts, const at::Tensor& weight,
                                   const std::vector<Range>& ranges);

// Projections overlapped with the exchanges (BSHD). Where project_head_parts computes every
// part before the exchange starts, these compute slab by slab: a slab is up to
// GroupOptions::message_bytes of one peer's heads over consecutive tokens of one batch entry,
// and the GEMM of the next slab runs while the previous one is on the wire.
//
// One input projection of x [B, S_r, E]: weight [H x D, E] with head-major rows (a Linear's),
// bias [H x D] or none, H the sharding's total of `heads`.
struct HeadProjection {
  at::Tensor weight;
  c10::optional<at::Tensor> bias;
  Heads heads = Heads::kQuery;
};
// y_t = scatter_heads(linear(x, W_t, b_t) viewed [B, S_r, H_t, D_t]) for each projection t:
// [B, S, |R_t[r]|, D_t] on rank r. Slabs for peers go out as they are projected; this rank's own
// heads are projected straight into y_t. Backward mirrors it: each peer's gradient slab gives
// its share of dx, dW and db as it arrives. Differentiable in x, the weights and biases; the
// sharding must be agreed for the projected shapes (agree_projection_plan).
std::vector<at::Tensor> scatter_projected(const at::Tensor& x,
                                          const std::vector<HeadProjection>& projections,
                                          const Sharding& sharding, const Group& group);
// out = linear(gather_heads(y) flattened to [B, S_r, Hq x D], weight) for y [B, S, |R[r]|, D]
// (query heads) and weight [E, Hq x D]: each peer's block of this rank's tokens is multiplied
// into out as it arrives, this rank's own block while the others travel. Backward sends each
// peer its gradient slab as soon as it is computed. Differentiable in y and weight.
at::Tensor gather_projected(const at::Tensor& y, const at::Tensor& weight, const Sharding& sharding,
                            const Group& group);
// The sharding of scatter_projected and gather_projected for x [B, S_r, E] and `projections`:
// checks x and each weight and bias against `heads` on this rank, then agree_plan on the
// projected shapes [B, S_r, H_t, D_t] (and `seq`, when given), so a mistake on any rank raises
// the same error on all.
Sharding agree_projection_plan(const Group& group, const HeadPartition& heads, const at::Tensor& x,
                               const std::vector<HeadProjection>& projections,
                               const c10::optional<SequencePartition>& seq = c10::nullopt);

// Gathers the sequence shards of `x` along `dim` into the full sequence:
// [.., S_r, ..] -> [.., S, ..] in rank order. Backward: reduce_scatter_sequence.
at::Tensor all_gather_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group);
// Sums `x` ([.., S, ..] on every rank) over the group and keeps this rank's rows along `dim`:
// [.., S_r, ..]. Backward: all_gather_sequence.
at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                   const Group& group);

// Convenience: agree_plan for `x` alone, then scatter_heads.
at::Tensor scatter_heads(const at::Tensor& x, const HeadPartition& partition, Heads heads,
                         Layout layout, const Group& group);

}  // namespace ulysses
