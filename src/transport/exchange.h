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

// Whether `group`'s CPU exchanges wait on links between hosts (messages or collectives, which
// Gloo's threads and the network carry) rather than run as copies through shared memory on this
// host's cores: while one waits, the cores are free for a kernel (Note [Overlapped chunks],
// partition.h). Read after the group's first CPU exchange; alike on every rank.
bool cpu_exchanges_wait_on_links(const Group& group);

}  // namespace ulysses
