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
// Note [Reused agreement]: after a call with a StepContext has agreed, the SP group's later
// calls skip their agreement round (one round per shape, not one per layer). A rank cannot skip
// a round on its own: if it skipped while another rank, whose call changed, went into the round,
// the two would meet in different collectives (Gloo aborts on that; NCCL hangs). So no rank
// decides alone, and the state that decides is the group's, not an argument's: the group's
// runtime arms itself with the agreed exchange (its sharding, this rank's q, k, v sizes, the
// fingerprints agreed with it), and while armed every attention call on the group, with a
// StepContext or without, moves q, k, v by that sharding with one more small tensor fused into the
// same exchange: the index of the call's fingerprint among the agreed ones, or 0 where the call
// differs or has no StepContext (it then sends zeros of the agreed sizes instead of its
// tensors). Every rank receives every rank's index, so every rank reaches the same verdict: all
// equal and nonzero, the exchange stands and no round ran; else the full agreement runs (naming
// what differs, alike on every rank) and the exchange again. An agreed call that may reuse joins
// the armed list (or replaces it, for other sizes); one that may not (no StepContext, a ring,
// head parts, unfused, a GPU tensor) disarms the group. Arming spans steps: the sequence of
// calls decides it, and it is the same on every rank. After kMaxMissesInARow misses in a row
// the group stops arming. Only CPU tensors reuse (reading the indexes is free there; on a GPU
// it would wait for the exchange), with every rank holding at least one token (each rank's
// index must reach every rank).
class StepContext {
 public:
  // `group` must be the SP group of the attention layers that use this context.
  explicit StepContext(Group group) : group_(std::move(group)) {}

  // rebuild_mask(mask, sharding, group), computed once per (mask, version, sharding); with a ring
  // `layout`, rebuild_ring_mask(mask, sharding, *layout, sp_rank, group) instead.
  at::Tensor rebuilt_mask(const at::Tensor& mask, const Sharding& sharding,
                          const RingLayout* layout = nullptr, int64_t sp_rank = 0);
  // ring_document_ids(positions, layout, ring), computed once per (positions, version, layout).
  at::Tensor ring_documents(const at::Tensor& positions, const RingLayout& layout,
                            const Group& ring);
  // all_gather_sequence(positions, -1, seq, group), computed once per (positions, version, seq).
  at::Tensor gathered_positions(const at::Tensor& positions, const SequencePartition& seq);
  // splits_documents(positions) (attention.h), read once per (positions, version): on a GPU
  // each read waits for the device, so a step's layers share one.
  bool splits_documents(const at::Tensor& positions);
  // Collectives saved by the cache so far (rebuilt masks, gathered ids served again).
  int64_t reuses() const { return reuses_; }
  // Agreement rounds this context's calls skipped (Note [Reused agreement]).
  int64_t agreements_reused() const { return agreements_reused_; }
  const Group& group() const { return group_; }

 private:
  // The orchestration (src/attention/distributed_attention.cpp) counts the rounds it skipped.
  friend struct StepContextAccess;
  // What a cached result was made from: its kind, its source tensor (held, so its identity
  // cannot be reused while cached) at a version, and the split it was built for.
  struct Key {
    enum class Kind { kMask, kPositions, kRingDocuments, kSplitsDocuments } kind;
    at::Tensor source;
    int64_t version = 0;
    std::vector<Range> q_ranges;       // The head split (empty: any).
    std::vector<int64_t> seq_lengths;  // The sequence split (empty: any).
    int64_t keys = -1;                 // The ring layout's S (-1: no ring).
    bool matches(const Key& other) const;
  };
  // build(), made once per `key` this step.
  at::Tensor once(Key key, const std::function<at::Tensor()>& build);
  Group group_;
  std::vector<std::pair<Key, at::Tensor>> cache_;  // This step's results, in order made.
  int64_t reuses_ = 0;                             // Cache hits so far.
  int64_t agreements_reused_ = 0;                  // Note [Reused agreement].
};

// How q, k and v move to heads: in one all-to-all, or in one each.
enum class QkvExchange { kFused, kSeparate };

// Options of a DistributedAttention.
struct AttentionOptions : AttentionRules {  // causal, scale, window (needs causal), softcap.
  // Total query heads Hq, >= 0; 0: taken from the first call's q. Hq >= the group size.
  int64_t q_heads = 0;
  // Total kv heads Hkv, >= 0; 0: taken from the first call's k. Hq must be a multiple of Hkv.
  int64_t kv_heads = 0;
  Layout layout = Layout::kBSHD;               // Dimension order of q, k, v and the output.
  QkvExchange exchange = QkvExchange::kFused;  // One all-to-all for q, k, v (else three).
  LocalKernel kernel = LocalKernel::kAuto;     // Local attention's kernel (attention.h).
  LocalAttention local;  // A local attention of the caller's; empty: `kernel`.
  // Attention in this many chunks of heads, one after another (Note [Head chunks] in
  // partition.h): each chunk's exchange buffers are made while it runs. 1: whole.
  int64_t head_chunks = 1;
  // Each chunk (the whole call where head_chunks is 1) keeps only its inputs for backward and
  // exchanges them again there (Note [Recomputed chunks] in partition.h): nothing by heads
  // lives from forward to backward, for one more exchange of q, k, v and o (on the fused
  // kernel, whose backward takes the saved log-sum-exp and o; elsewhere the kernel's forward
  // runs again too). Backward reads the output: keep it unchanged until then.
  bool recompute_chunks = false;
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
// Hybrid Ulysses x ring attention runs the fused kernel: `kernel` must be kAuto or kFused, not a
// local attention of the caller's (nullopt); raises c10::ValueError.
void check_ring_kernel(const c10::optional<LocalKernel>& kernel);

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
