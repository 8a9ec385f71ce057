// GroupOptions as the dispatcher ops carry them (an `int[] group_options`): [timeout ms,
// pipeline_min_bytes, message_bytes, shared_memory, transport]; a shorter list leaves the rest at
// their defaults. Python writes the same list (ulysses.ops.group_options).
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "ulysses/group.h"

namespace ulysses {

std::vector<int64_t> options_to_ints(const GroupOptions& options);
GroupOptions options_from_ints(c10::IntArrayRef values);

}  // namespace ulysses
