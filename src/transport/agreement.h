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

}  // namespace detail

// This rank's CallFingerprint of a call after its local checks (those of agree_plan that need
// no other rank; raises naming the argument): what agree_plan moves.
CallFingerprint call_fingerprint(const Group& group, const HeadPartition& heads, Layout layout,
                                 const std::vector<TensorSpec>& tensors,
                                 const c10::optional<SequencePartition>& seq,
                                 const CallOptions& call);

}  // namespace ulysses
