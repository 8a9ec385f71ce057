#include "ulysses/attention_rules.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace ulysses {

void check_window(int64_t window, bool causal) {
  TORCH_CHECK_VALUE(window >= 0 && (window == 0 || causal),
                    "attention: a sliding window is a causal rule: give window > 0 with "
                    "causal=True (or window 0 for none); got window ",
                    window, " with causal=", causal ? "True" : "False");
}

void check_softcap(double softcap) {
  TORCH_CHECK_VALUE(softcap >= 0 && std::isfinite(softcap),
                    "attention: softcap must be 0 (none) or a finite positive number (scores s "
                    "become softcap * tanh(s / softcap)); got ",
                    softcap);
}

void AttentionRules::check() const {
  check_window(window, causal);
  check_softcap(softcap);
}

}  // namespace ulysses
