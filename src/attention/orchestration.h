// The one orchestration of an attention call (Note [One orchestration]), private to the
// library: DistributedAttention (C++) and torch.ops.ulysses.attention (Python) both call it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

#include "transport/ops.h"
#include "ulysses/distributed_attention.h"

namespace ulysses {

// One attention call as the orchestration takes it (every field but the tensors).
struct AttentionCall : AttentionRules {  // causal, scale, window, softcap.
  explicit AttentionCall(Group sp_group) : group(std::move(sp_group)) {}
  Group group;                 // The Ulysses (SP) group.
  Group ring = Group::solo();  // Hybrid attention's ring group (1 rank: none).
  int64_t q_heads = 0;         // Totals; 0: read from the call's q (or k).
  int64_t kv_heads = 0;
  c10::optional<SequencePartition> seq;  // A known split (checked); else learned in the round.
  Layout layout = Layout::kBSHD;
  c10::optional<at::Tensor> sinks;  // [Hq] (AttentionInputs::sinks); unset: none.
  bool fuse_qkv = true;
  LocalKernel kernel = LocalKernel::kAuto;
  const LocalAttention* local = nullptr;  // Overrides `kernel`.
  StepContext* step = nullptr;            // Shares rebuilt masks and positions across layers.
  bool mask_rebuilt = false;              // The mask is rebuild_mask's output for these heads.
  bool heads_only = false;                // attention_heads: the caller attends (its own kernel).
};

// Attention's inputs after the exchange: q, k, v on this rank's heads over the whole sequence
// (BHSD), the mask rebuilt and the position ids gathered, with the agreed plan.
struct AttentionHeads {
  LocalAttentionArgs args;
  Sharding plan;
  c10::optional<RingLayout> ring;  // Hybrid attention's layout (then args.positions is unset
  at::Tensor ring_documents;       // and these are the ring's document ids, if any).
};

// Note [One orchestration]: the body of every attention call, from C++ (DistributedAttention)
// and from Python (torch.ops.ulysses.attention, whose kernel calls it). `qkv` holds q, k, v as
// one tensor each, or as head parts (HeadForm::kParts). Steps: agree (the call fingerprint, before
// any data moves) -> exchange -> mask and positions -> local attention -> exchange back. With a
// known split and no ring every collective runs inside a dispatcher op, so torch.compile
// traces the whole call. Returns o (one tensor, or o's parts).
std::vector<at::Tensor> attend(const AttentionCall& call,
                               const std::vector<std::vector<at::Tensor>>& qkv, HeadForm form,
                               const c10::optional<at::Tensor>& mask,
                               const c10::optional<at::Tensor>& positions);
// attend's first half, for a local attention of the caller's.
AttentionHeads attend_heads(const AttentionCall& call,
                            const std::vector<std::vector<at::Tensor>>& qkv, HeadForm form,
                            const c10::optional<at::Tensor>& mask,
                            const c10::optional<at::Tensor>& positions);

}  // namespace ulysses
