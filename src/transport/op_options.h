// The groups the dispatcher ops take: a process group by its torch.distributed name (as torch's
// functional collectives do; "" is this rank alone) and the handle's GroupOptions as an
// `int[] group_options`: [timeout ms (-1: the group's own), pipeline_min_bytes, message_bytes,
// shared_memory (-1: unset), transport]; a shorter list leaves the rest at their defaults.
// Python writes the prefix [timeout ms] (ulysses.groups.Wait.options).
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ulysses/group.h"

namespace ulysses {

std::vector<int64_t> options_to_ints(const GroupOptions& options);
GroupOptions options_from_ints(c10::IntArrayRef values);

// The group an op names: "" is Group::solo(); `options` as options_from_ints reads them.
Group group_of_op(const std::string& name, c10::IntArrayRef options);
// The name ops find `group` by (group_of_op): its c10d name, registered with c10d first if the
// process group was handed over without one; "" for a solo group.
std::string op_group_name(const Group& group);

}  // namespace ulysses
