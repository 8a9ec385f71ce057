// Head parts (all_to_all.h): one tensor per rank holding that rank's heads, checked against a
// sharding or a partition.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "ulysses/all_to_all.h"
#include "ulysses/group.h"
#include "ulysses/partition.h"

namespace ulysses {

// Checks that `parts` are this rank's tokens of every rank's heads, by the agreed sharding; raises
// c10::ValueError naming the first part that is not, under `op`.
void check_parts(const char* op, const std::vector<at::Tensor>& parts, Heads kind,
                 const Sharding& sharding, const Group& group);

// A stand-in for the whole tensor that `parts` split (one part per rank, by `partition`'s
// ranges of `heads` in `layout`): one element expanded to the whole shape, with the parts'
// dtype, device and requires-grad, for agree_plan to check and agree on without the data.
// Raises c10::ValueError naming `who` when the parts do not fit the partition (a local check:
// run it where a failure reaches every rank, e.g. inside Group::agree or fail_together).
at::Tensor stand_in_for_parts(const std::vector<at::Tensor>& parts, Heads heads,
                              const HeadPartition& partition, Layout layout,
                              const std::string& who);

}  // namespace ulysses
