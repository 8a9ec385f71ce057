// The call fingerprint: what every rank of an SP group must hold alike for one call (an
// attention call or a bare exchange), as a value with named fields. Private to the library
// (its tests include it).
//
// agree_plan builds one per rank from the call's tensors and options, the agreement round moves
// it as integers (encode / decode), and `check_alike` names the first field in which the ranks
// differ, with every rank's value. Pure: no tensors, no collectives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ulysses/attention_rules.h"

namespace ulysses {

// One input tensor of a call as this rank holds it.
struct TensorFacts {
  bool given = false;
  std::vector<int64_t> sizes;   // Empty when not given.
  int64_t dtype = -1;           // c10::ScalarType; -1 when not given.
  int64_t device_type = -1;     // c10::DeviceType; -1 when not given.
  bool on_first_device = true;  // On the call's first tensor's device (type and index).
  bool requires_grad = false;
};

struct CallFingerprint : AttentionRules {  // causal, scale, window, softcap.
  // The plan.
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t sp_size = 0;
  int64_t layout = 0;      // ulysses::Layout.
  int64_t seq_split = -1;  // Hash of a given sequence split; -1: learned in the round.
  // The group handle's exchange options (they choose the exchange path and message cuts).
  int64_t pipeline_min_bytes = 0;
  int64_t message_bytes = 0;
  int64_t shared_memory = 0;
  int64_t batched = 0;  // Group::batches for the call's device (GroupOptions::transport).
  // The exchanged tensors, in call order.
  std::vector<TensorFacts> tensors;
  // The attention call's options (their defaults for a bare exchange).
  TensorFacts mask;
  TensorFacts positions;
  TensorFacts sinks;  // Attention sinks [Hq].
  bool step_context = false;
  bool reuses_agreement = false;  // CallOptions::reuses_agreement.
  // The S x S buffer C++ makes running CallOptions::local_kernel off the CPU (SquareBuffer:
  // 0 none, 1 the math kernel's scores, 2 SDPA's rule mask; Note [No silent S x S],
  // attention.h).
  int64_t square_off_cpu = 0;

  // The integers the agreement round moves; decode(encode()) == *this.
  std::vector<int64_t> encode() const;
  static CallFingerprint decode(const std::vector<int64_t>& values);
};

// Raises c10::ValueError (TypeError for dtypes) naming the first field in which `all` (every
// rank's fingerprint, rank order) differ, with every rank's value. The sequence dim of the
// exchanged tensors and the mask's sizes may differ (their rules are checked elsewhere).
// `names` name the exchanged tensors in messages; `who` prefixes them.
void check_alike(const std::vector<CallFingerprint>& all, const std::vector<std::string>& names,
                 const std::string& who);

}  // namespace ulysses
