// DistributedAttention: Ulysses sequence-parallel attention around a local attention.
//
//   q, k, v on this rank's sequence shard [B, S_r, H, D] (BSHD; or SBHD, BHSD)
//     --scatter_heads (one fused all-to-all)-->  [B, S, my heads, D]
//   mask rebuilt for (all queries, my heads); position ids gathered to [B, S]
//   local attention on my heads over the full sequence (GQA through the partition's kv map)
//     --gather_heads-->  o on this rank's shard [B, S_r, Hq, Dv]
//
// Head counts belong to the instance (from the options, or captured from the first call's
// tensors): two instances with different head counts share a process freely.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

#include "ulysses/all_to_all.h"
#include "ulysses/attention.h"
#include "ulysses/attention_rules.h"
#include "ulysses/group.h"
#include "ulysses/partition.h"
#include "ulysses/ring_attention.h"

namespace ulysses {

// Per-forward-step state shared by the attention layers of one model: a mask (and position
// ids) shared by several layers is rebuilt (gathered) once per step, not once per layer.
// Entries are keyed by the source tensor's identity and version, so a changed mask is never
// served stale. Create one per forward step; it must not outlive the step's tensors' use.
//
// Note [Reused agreement]: the step also keeps its first call's agreement, so that the later
// layers of a forward skip their agreement round (one round per step, not one per layer).
// A rank cannot skip a round on its own: if it skipped while another rank, whose call changed,
// went into the round, the two would meet in different collectives (Gloo aborts on that; NCCL
// hangs). So no rank decides alone. Once the step holds an agreed exchange (its plan, this
// rank's q, k, v sizes, the fingerprints agreed with it), every later call of the step moves
// q, k, v by that plan with one more small tensor fused into the same exchange: the index of
// the call's fingerprint among the agreed ones, or 0 where the call differs (it then sends
// zeros of the agreed sizes instead of its tensors). Every rank receives every rank's index,
// so every rank reaches the same verdict: all equal and nonzero, the exchange stands and no
// round ran; else every rank counts a miss and runs the full agreement (which names what
// differs, alike on every rank) and the exchange again, and an agreed call joins the step's
// list (or replaces it, for other sizes). Only CPU tensors reuse (reading the indexes is free
// there; on a GPU it would wait for the exchange), with every rank holding at least one token
// (each rank's index must reach every rank).
// Not covered: the StepContext argument itself differing mid-step (one rank passing none, or
// a fresh one, while the others pass the armed one). That rank goes into the agreement round
// while the others move by the agreed plan: they wait on each other until the group's timeout.
// A rank cannot see that from its own state; the fix is an armed state held by the group's
// runtime (alike on every rank whatever the argument), not by the StepContext.
class StepContext {
 public:
  // `group` must be the SP group of the attention layers that use this context.
  explicit StepContext(Group group) : group_(std::move(group)) {}

  // rebuild_mask(mask, plan, group), computed once per (mask, version, plan); with a ring
  // `layout`, rebuild_ring_mask(mask, plan, *layout, sp_rank, group) instead.
  at::Tensor rebuilt_mask(const at::Tensor& mask, const Sharding& plan,
                          const RingLayout* layout = nullptr, int64_t sp_rank = 0);
  // ring_document_ids(positions, layout, ring), computed once per (positions, version, layout).
  at::Tensor ring_documents(const at::Tensor& positions, const RingLayout& layout,
                            const Group& ring);
  // all_gather_sequence(positions, -1, seq, group), computed once per (positions, version, seq).
  at::Tensor gathered_positions(const at::Tensor& positions, const SequencePartition& seq);
  // Collectives saved by reuse so far (for tests and logs).
  int64_t reuses() const { return reuses_; }
  const Group& group() const { return group_; }

  // The step's agreed exchange (Note [Reused agreement]).
  struct Agreed {
    Sharding plan;
    std::vector<std::vector<int64_t>> sizes;  // This rank's q, k, v sizes under `plan`.
    at::ScalarType dtype = at::kFloat;
    std::vector<std::vector<int64_t>> calls;  // This rank's fingerprints agreed with `plan`.
  };
  // The agreed exchange later calls move by; null when none, or after kMaxMisses calls of
  // the step differed from it (every rank counts the same misses).
  const Agreed* agreed() const { return agreed_ && misses_ < kMaxMisses ? &*agreed_ : nullptr; }
  // After an agreement every rank ran alike: keep `call` (this rank's fingerprint) with its
  // exchange (q, k, v as moved), replacing an agreed exchange of other sizes.
  void remember(const Sharding& plan, const std::vector<at::Tensor>& qkv,
                const std::vector<int64_t>& call);
  // After an exchange by agreed(), whose indexes every rank read alike.
  void exchanged(bool reused) { ++(reused ? agreements_reused_ : misses_); }
  // Agreement rounds skipped so far (for tests and logs).
  int64_t agreements_reused() const { return agreements_reused_; }
  static constexpr int64_t kMaxMisses = 4;
  static constexpr size_t kMaxAgreedCalls = 32;  // Indexes travel exactly in bf16.

 private:
  struct Entry {
    at::Tensor source;                 // Held so its identity cannot be reused while cached.
    int64_t version = 0;               // source's version counter when cached.
    std::vector<Range> q_ranges;       // The head split the result was built for.
    std::vector<int64_t> seq_lengths;  // The sequence split likewise.
    int64_t keys = -1;                 // The ring layout's S (-1: no ring).
    at::Tensor result;
  };
  at::Tensor lookup(std::vector<Entry>& entries, const at::Tensor& source,
                    const std::vector<Range>& q_ranges, const SequencePartition& seq, int64_t keys,
                    const std::function<at::Tensor()>& build);
  Group group_;
  std::vector<Entry> masks_;      // Rebuilt masks of this step.
  std::vector<Entry> positions_;  // Gathered position ids of this step.
  std::vector<Entry> documents_;  // Ring document ids of this step.
  int64_t reuses_ = 0;            // Cache hits so far.
  c10::optional<Agreed> agreed_;  // Note [Reused agreement].
  int64_t agreements_reused_ = 0;
  int64_t misses_ = 0;
};

// Options of a DistributedAttention.
struct AttentionOptions : AttentionRules {  // causal, scale, window (needs causal), softcap.
  // Total query heads Hq, >= 0; 0: taken from the first call's q. Hq >= the group size.
  int64_t q_heads = 0;
  // Total kv heads Hkv, >= 0; 0: taken from the first call's k. Hq must be a multiple of Hkv.
  int64_t kv_heads = 0;
  Layout layout = Layout::kBSHD;            // Dimension order of q, k, v and the output.
  bool fuse_qkv = true;                     // Move q, k, v in one all-to-all (else three).
  LocalKernel kernel = LocalKernel::kAuto;  // Local attention's kernel (attention.h).
  LocalAttention local;                     // A local attention of the caller's; empty: `kernel`.
};

// Optional per-call inputs.
struct AttentionInputs {
  c10::optional<at::Tensor> mask;        // See mask.h for accepted shapes; bool or additive.
  c10::optional<at::Tensor> positions;   // This shard's global position ids, [B, S_r] or [S_r].
  StepContext* context = nullptr;        // Shares rebuilt masks/positions across layers.
  c10::optional<SequencePartition> seq;  // Known sequence split (checked); else learned.
  // Attention sinks (attention.h), [Hq]: one learnable logit per query head, owned by the
  // caller's module. Each rank applies its heads' entries; its gradient holds only those (sum
  // gradients over the group, as for every parameter).
  c10::optional<at::Tensor> sinks;
};

// The rules of a DistributedAttention's options (Python's constructor checks them too, through
// _C): head counts >= 0 (0: taken from the first call) and the call's rules; raises
// c10::ValueError.
void check_attention_options(int64_t q_heads, int64_t kv_heads, const AttentionRules& rules);
// Hybrid Ulysses x ring attention runs the fused kernel: `kernel` must be kAuto or kFused, and
// no callable (`callable`) local attention; raises c10::ValueError.
void check_ring_kernel(LocalKernel kernel, bool callable);

class DistributedAttention {
 public:
  DistributedAttention(Group group, AttentionOptions options = {});
  // Hybrid Ulysses x ring attention (see ring_attention.h): the all-to-alls run over `ulysses`
  // (U ranks), key/value blocks circulate over `ring` (R ranks, each holding the same heads).
  // Inputs are this rank's shard of the zigzag RingLayout (RingLayout::shard). Causal and packed
  // documents (position ids) are evaluated per tile; a mask's query rows are this rank's
  // shard's (or all S, or 1) and its keys all S in global order (or 1), each ring step reading
  // the columns of the block at hand.
  DistributedAttention(Group ulysses, Group ring, AttentionOptions options = {});

  // o = attention(q, k, v) on this rank's sequence shard; shapes in options().layout:
  // q [B, S_r, Hq, D], k [B, S_r, Hkv, D], v [B, S_r, Hkv, Dv] -> o [B, S_r, Hq, Dv] (BSHD).
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionInputs& inputs = {});
  at::Tensor operator()(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const AttentionInputs& inputs = {}) {
    return forward(q, k, v, inputs);
  }
  // The same attention with q, k, v given as head parts (all_to_all.h: part j holds the heads
  // rank j of the group gets, as project_head_parts makes them) and o returned as parts
  // (project_from_head_parts takes them): nothing is packed or unpacked around the
  // all-to-alls. The head counts must be in the options (parts do not show the totals).
  // Parts that do not fit the partition on any rank raise the same error on every rank.
  std::vector<at::Tensor> forward_parts(const std::vector<at::Tensor>& q,
                                        const std::vector<at::Tensor>& k,
                                        const std::vector<at::Tensor>& v,
                                        const AttentionInputs& inputs = {});

  // The head partition (set from the options, or after the first call).
  const c10::optional<HeadPartition>& partition() const { return partition_; }
  const AttentionOptions& options() const { return options_; }
  const Group& group() const { return group_; }
  const Group& ring() const { return ring_; }

 private:
  Group group_;
  Group ring_ = Group::solo();
  AttentionOptions options_;
  c10::optional<HeadPartition> partition_;  // Fixed once known; every call must match it.
};

}  // namespace ulysses
