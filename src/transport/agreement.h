// The call's agreement, private to the library: the fingerprint each rank contributes.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <sstream>
#include <string>
#include <vector>

#include "plan/call_fingerprint.h"
#include "ulysses/all_to_all.h"
#include "ulysses/attention_rules.h"

namespace ulysses {

namespace detail {

// A shape as messages print it: [2, 3, 4].
inline std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

// The exchange an SP group's attention calls move by without an agreement round, held by the
// group's runtime so that every rank arms, misses and disarms alike, whatever each call's
// arguments (Note [Reused agreement], distributed_attention.h). Calls on one group are issued
// in one order on every rank, as their collectives are: no lock.
class ArmedAgreement {
 public:
  struct Exchange {
    Sharding sharding;
    std::vector<std::vector<int64_t>> sizes;  // This rank's q, k, v sizes under `sharding`.
    at::ScalarType dtype = at::kFloat;
    std::vector<std::vector<int64_t>> calls;  // This rank's fingerprints agreed with `sharding`.
  };
  // The exchange calls move by; null when not armed.
  const Exchange* armed() const {
    return exchange_ && misses_in_a_row_ < kMaxMissesInARow ? &*exchange_ : nullptr;
  }
  // After an agreement every rank ran alike, of a call that may reuse: keep `call` (this rank's
  // fingerprint) with its exchange (q, k, v as moved), replacing an exchange of other sizes.
  void remember(const Sharding& sharding, const std::vector<at::Tensor>& qkv,
                const std::vector<int64_t>& call);
  // After an agreement of a call that may not reuse.
  void disarm() { exchange_.reset(); }
  // After an exchange by armed(), whose indexes every rank read alike.
  void exchanged(bool reused) { misses_in_a_row_ = reused ? 0 : misses_in_a_row_ + 1; }
  static constexpr int64_t kMaxMissesInARow = 4;  // Then the group stops arming.
  static constexpr size_t kMaxCalls = 32;         // Indexes travel exactly in bf16.

 private:
  c10::optional<Exchange> exchange_;
  int64_t misses_in_a_row_ = 0;
};

}  // namespace detail

// The options of a call that every rank must hold alike besides its tensors: for an attention
// call its mask and position ids (facts, not data), causal flag, scale and whether a
// StepContext is used. A bare exchange leaves the defaults.
struct CallOptions : AttentionRules {   // causal, scale, window, softcap.
  bool attention = false;               // The tensors are q, k, v (k's head dim is q's).
  c10::optional<at::Tensor> mask;       // Checked against every rank's shape (mask_decision.h).
  c10::optional<at::Tensor> positions;  // [B, S_r] (positions_for_call expands [S_r]).
  c10::optional<at::Tensor> sinks;      // Attention sinks [Hq] (attention.h); facts, not data.
  bool step_context = false;
  // With a StepContext: a later call on the group like this one reuses this call's agreement
  // (Note [Reused agreement], distributed_attention.h). Whole q, k, v moved fused, no ring.
  bool reuses_agreement = false;
  // An attention call's local kernel (LocalKernel as an integer); -1: the caller's own, or no
  // attention. Agreed: off the CPU it decides the refusal of Note [No silent S x S].
  int64_t local_kernel = -1;
  // Set when the call computes on a CPU-only kernel (it names it): other devices are refused
  // in the agreement, alike on every rank, before data moves.
  const char* cpu_only = nullptr;
  // Who checks the mask's shape: the agreement, or the caller (the ring's rules).
  enum class MaskCheck { kAgreement, kCaller } mask_check = MaskCheck::kAgreement;
};

// agree_plan for one call with its options: also every rank's CallFingerprint (call_fingerprint.h)
// of them must match, and a mask's shape is checked against every rank's (mask_decision.h).
Sharding agree_plan(const Group& group, const HeadPartition& heads, Layout layout,
                    const std::vector<TensorSpec>& tensors,
                    const c10::optional<SequencePartition>& seq, const CallOptions& call);

// Raises c10::ValueError naming the first of `tensors` that is not 4-D (in `layout`).
void check_4d(const std::vector<TensorSpec>& tensors, Layout layout);

// Position ids in the one form a call agrees on: [S_r] (the same positions for every batch
// row) expanded to q's [B, S_r]; [B, S_r] and anything else as given.
c10::optional<at::Tensor> positions_for_call(const c10::optional<at::Tensor>& positions,
                                             const at::Tensor& q, Layout layout);

// This rank's CallFingerprint of a call after its local checks (those of agree_plan that need
// no other rank; raises naming the argument): what agree_plan moves.
CallFingerprint call_fingerprint(const Group& group, const HeadPartition& heads, Layout layout,
                                 const std::vector<TensorSpec>& tensors,
                                 const c10::optional<SequencePartition>& seq,
                                 const CallOptions& call);

}  // namespace ulysses
