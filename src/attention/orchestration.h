// The one orchestration of an attention call (Note [One orchestration]), private to the
// library: DistributedAttention (C++) and torch.ops.ulysses.attention (Python) both call it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

#include "transport/ops.h"
#include "ulysses/distributed_attention.h"

namespace ulysses {

// The mask a call hands over: as the caller gave it (query rows sharded, agreed and rebuilt by
// the call), or already rebuild_mask's output for these heads (AutoSP rebuilds once per graph).
enum class MaskForm { kAsGiven, kRebuilt };
// Who runs a call's local attention: the library (its kernel, or a C++ callable `local`), or the
// caller after attend_heads (Python's callable or FlexAttention: attention_heads).
enum class LocalBy { kLibrary, kCaller };

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
  QkvExchange exchange = QkvExchange::kFused;
  LocalKernel kernel = LocalKernel::kAuto;
  const LocalAttention* local = nullptr;    // Overrides `kernel`.
  StepContext* step = nullptr;              // Shares rebuilt masks and positions across layers.
  MaskForm mask_form = MaskForm::kAsGiven;  // The mask as the caller gave it, or rebuilt.
  LocalBy local_by = LocalBy::kLibrary;     // Who runs the local attention (after attend_heads).
};

// Attention's inputs after the exchange: q, k, v on this rank's heads over the whole sequence
// (BHSD), the mask rebuilt and the position ids gathered, with the agreed sharding.
struct AttentionHeads {
  LocalAttentionArgs args;
  Sharding sharding;
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
// Raises `error` on every rank of `group` from a point where the other ranks start an attention
// call on it (a check of this rank's before its call): through the group's armed exchange first
// when it is armed (Note [Reused agreement]; this rank's index 0 sends every rank on to the full
// agreement), then the agreement round, which the others' calls run next.
[[noreturn]] void fail_attention_together(const Group& group, const std::exception_ptr& error);
// fail_together_on_error (group.h) for a check before an attention call: `prepare`'s failure is
// raised through fail_attention_together.
template <typename Fn>
auto fail_attention_together_on_error(const Group& group, Fn&& prepare) {
  try {
    return prepare();
  } catch (const std::exception&) {
    fail_attention_together(group, std::current_exception());
  }
}
// attend on `count` chunks of heads in turn (Note [Head chunks], partition.h), each with
// `recompute` keeping only its inputs for backward (Note [Recomputed chunks]); `in`'s mask and
// positions are the call's (the sinks are call.sinks). A count this rank cannot make fails every
// rank alike. Returns o.
at::Tensor attend_in_head_chunks(AttentionCall call, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const AttentionInputs& in, int64_t count,
                                 bool recompute);
// attend's first half, for a local attention of the caller's.
AttentionHeads attend_heads(const AttentionCall& call,
                            const std::vector<std::vector<at::Tensor>>& qkv, HeadForm form,
                            const c10::optional<at::Tensor>& mask,
                            const c10::optional<at::Tensor>& positions);

}  // namespace ulysses
