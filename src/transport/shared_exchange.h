// Exchanges between ranks all on one host, through their shared-memory outboxes with no message
// at all (Note [Flag handshake] in shared_exchange.cpp).
#pragma once

#include "transport/exchange_blocks.h"
#include "ulysses/exchange_plan.h"
#include "ulysses/group.h"

namespace ulysses {

// Executes `plan` through the outboxes of the group's ranks, handing over with flags in their
// control pages. Returns false, on every rank alike, when it moved nothing: the ranks are not all
// linked (another host, shared memory unusable), or some rank's outbox could not grow (then every
// link of the group is dropped, one warning); the caller runs the exchange another way. Raises on
// every rank alike when a rank cannot map a peer's outbox, and on a peer silent for
// GroupOptions::timeout.
bool exchange_through_outboxes(const BlockTensors& in, const BlockTensors& out,
                               const ExchangePlan& plan, const Group& group);

}  // namespace ulysses
