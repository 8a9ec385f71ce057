// Executing an ExchangePlan: in one collective, or (large CPU exchanges) as pipelined
// point-to-point messages, blocks for co-located ranks through shared memory.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "transport/ops.h"
#include "ulysses/exchange_plan.h"
#include "ulysses/group.h"
#include "ulysses/partition.h"

namespace ulysses {

// Executes `plan` from `xs` (whole tensors, or parts by peer) into fresh outputs (whole, or
// parts by peer): large CPU exchanges as pipelined messages, the
// rest in one collective (GroupOptions::pipeline_min_bytes). Every rank decides alike, from
// sizes the plan has the same on every rank.
std::vector<at::Tensor> exchange(const std::vector<at::Tensor>& xs, HeadForm from,
                                 const ExchangePlan& plan, Layout layout, HeadForm to,
                                 const Group& group);

}  // namespace ulysses
