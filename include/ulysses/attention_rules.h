// The rules of one attention call: what every rank, every kernel and the call's agreement
// apply alike. One value, carried by every struct that holds a call's rules
// (LocalAttentionArgs, AttentionOptions, AttentionCall, CallOptions, CallFingerprint), so a
// rule added here reaches each of them and is copied in one assignment. Pure: no tensors
// (attention sinks are a tensor and travel beside the rules, their form in the fingerprint).
#pragma once

#include <cstdint>

namespace ulysses {

struct AttentionRules {
  bool causal = false;   // Query i sees keys j <= i (within each document when packed).
  double scale = 0.0;    // Softmax scale; 0 means 1/sqrt(D).
  int64_t window = 0;    // Sliding window, with causal: i - window < j <= i; 0: none.
  double softcap = 0.0;  // Logit softcap: s becomes softcap * tanh(s / softcap); 0: none.

  // This value as the rules alone, for copying between the structs that carry them.
  const AttentionRules& rules() const { return *this; }
  AttentionRules& rules() { return *this; }
  // Throws c10::ValueError naming the first rule broken (check_window, check_softcap).
  void check() const;
};

// The sliding-window rule: throws c10::ValueError unless window is 0 (none), or > 0 with
// causal attention.
void check_window(int64_t window, bool causal);
// The logit-softcap rule: throws c10::ValueError unless softcap is 0 (none) or a finite
// positive number.
void check_softcap(double softcap);

}  // namespace ulysses
