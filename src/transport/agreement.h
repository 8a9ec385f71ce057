// The call's agreement, private to the library: the fingerprint each rank contributes.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <sstream>
#include <string>
#include <vector>

#include "plan/call_fingerprint.h"
#include "ulysses/all_to_all.h"

namespace ulysses {

namespace detail {

// A shape as messages print it: [2, 3, 4].
inline std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

// Head kinds as messages name them.
inline const char* heads_word(Heads h) { return h == Heads::kQuery ? "query" : "kv"; }

// The exchange an SP group's attention calls move by without an agreement round, held by the
// group's runtime so that every rank arms, misses and disarms alike, whatever each call's
// arguments (Note [Reused agreement], distributed_attention.h). Calls on one group are issued
// in one order on every rank, as their collectives are: no lock.
class ArmedAgreement {
 public:
  struct Exchange {
    Sharding plan;
    std::vector<std::vector<int64_t>> sizes;  // This rank's q, k, v sizes under `plan`.
    at::ScalarType dtype = at::kFloat;
    std::vector<std::vector<int64_t>> calls;  // This rank's fingerprints agreed with `plan`.
  };
  // The exchange calls move by; null when not armed.
  const Exchange* armed() const {
    return exchange_ && misses_in_a_row_ < kMaxMissesInARow ? &*exchange_ : nullptr;
  }
  // After an agreement every rank ran alike, of a call that may reuse: keep `call` (this rank's
  // fingerprint) with its exchange (q, k, v as moved), replacing an exchange of other sizes.
  void remember(const Sharding& plan, const std::vector<at::Tensor>& qkv,
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

// This rank's CallFingerprint of a call after its local checks (those of agree_plan that need
// no other rank; raises naming the argument): what agree_plan moves.
CallFingerprint call_fingerprint(const Group& group, const HeadPartition& heads, Layout layout,
                                 const std::vector<TensorSpec>& tensors,
                                 const c10::optional<SequencePartition>& seq,
                                 const CallOptions& call);

}  // namespace ulysses
