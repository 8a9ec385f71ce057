// Every ULYSSES_* environment variable, declared here and read nowhere else (as c10d lists its
// own in one place). The library's, read each time a call resolves its group options:
//   ULYSSES_SHARED_MEMORY  "0": pipelined exchanges skip shared memory (GroupOptions::
//                          shared_memory when unset); anything else, or unset: on.
//   ULYSSES_TRANSPORT      auto | messages | batched: GroupOptions::Transport::kAuto's choice.
//   ULYSSES_OVERLAP_CHUNKS 1 | 0 | auto: whether recomputed head chunks run a chunk's kernel
//                          while the next chunk's exchange runs (Note [Overlapped chunks],
//                          partition.h); auto (or unset): where CPU exchanges wait on links.
// The CLI's, in test builds only (its test hooks, read where they act):
//   ULYSSES_TEST_CRASH_BEFORE_COMMIT  set: `ulysses train --save` dies before its commit point
//                                     (tools/train_checkpoint.cpp).
//   ULYSSES_TEST_LAST_RANK_LATE_MS    ms: the last rank of `ulysses train` starts step 3 this
//                                     late (tools/train.cpp).
#pragma once

#include <optional>

#include "ulysses/group.h"

namespace ulysses {

// ULYSSES_SHARED_MEMORY's word: false for "0", else true (unset too).
bool shared_memory_from_environment();
// Whether pipelined exchanges under `options` go through shared memory: its shared_memory, or
// when unset the environment's.
inline bool uses_shared_memory(const GroupOptions& options) {
  return options.shared_memory.value_or(shared_memory_from_environment());
}
// ULYSSES_TRANSPORT's transport, or nullopt when unset or empty; raises c10::ValueError for any
// other text.
std::optional<GroupOptions::Transport> transport_from_environment();
// ULYSSES_OVERLAP_CHUNKS's word: true for "1", false for "0", nullopt when unset, empty or
// "auto"; raises c10::ValueError for any other text.
std::optional<bool> overlap_chunks_from_environment();

}  // namespace ulysses
