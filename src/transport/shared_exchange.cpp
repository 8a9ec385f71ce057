#include "transport/shared_exchange.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "transport/group_runtime.h"
#include "transport/shared_memory.h"
#include "transport/wait.h"
#include "ulysses/collective_recorder.h"

namespace ulysses {

// Note [Flag handshake]
// A small exchange costs far more to hand over than to copy: a Gloo all-to-all or a message
// handshake about 0.4 ms on this machine, a 512 KB copy 0.04 ms. So when every rank of the group
// is linked through shared memory (SharedMemoryLinks::all_linked, alike on every rank), CPU
// exchanges go through the outboxes and hand over with flags in their control pages, no message
// at all: two copies per block. At large sizes too this beats the pipelined path's messages and
// notices (docs/benchmarks.md), which serve groups spread over hosts. Exchange number n (alike on
// every rank):
//  1. each rank grows its outbox to hold its blocks for every peer (kChunks + j: where peer j's
//     start), sets kBytes and kPackError (the errno of a failure to grow), then kPacked =
//     n * kStages;
//  2. waits until every peer's kPacked reaches that. A rank that could not grow its outbox is
//     seen by every rank here: all return false (the caller runs the exchange another way) and
//     drop every link for good (later exchanges go as messages or collectives);
//  3. maps the outboxes it reads (anew where one grew);
//  4. for each fused tensor t: packs its blocks, sets kPacked = n * kStages + t + 1, waits until
//     every peer's reaches that, and copies the peers' blocks of t out (a tensor's blocks stay
//     in the cache between pack and copy: one fused exchange of three tensors beats three);
//  5. sets kReadError, then kRead = n, and waits until every peer's kRead >= n: no one reads its
//     outbox any more, so the next exchange may overwrite it. A failure to map a peer's outbox
//     raises the lowest failing rank's error on every rank.
// kPacked and kRead are stored with release order and loaded with acquire order, so the blocks
// and fields written before them are seen after them. A wait yields a while, then naps, longer
// and longer (ranks may outnumber cores); past GroupOptions::log_wait_fraction of the timeout it
// logs, past the timeout it raises, naming the exchange and the ranks it waits for, as a
// collective's wait does (wait.h).
namespace {

using detail::SharedMemoryLinks;

// kPacked holds exchange * kStages + the fused tensors packed so far: exchange * kStages alone
// once the rank's room (or its failure) is known.
constexpr int64_t kStages = 1024;

// Waits until every peer's `field` is at least `n` (Note [Flag handshake]).
void wait_for_peers(const Group& g, const SharedMemoryLinks& links, int field, int64_t n,
                    int64_t number) {
  using Clock = std::chrono::steady_clock;
  const auto begun = Clock::now();
  const auto first = log_wait_after(g.options());
  bool logged = first == g.options().timeout;
  auto waiting_for = [&] {
    return ranks_where(g, [&](int j) { return links.peer_field(j, field) < n; });
  };
  auto nap = std::chrono::microseconds(10);
  for (int j = 0; j < g.size(); ++j) {
    if (j == g.rank()) continue;
    for (int64_t spin = 0; links.peer_field(j, field) < n; ++spin) {
      if (spin < 1024) {
        std::this_thread::yield();
        continue;
      }
      // A peer still busy (its kernel, or no core yet): naps grow to 0.5 ms, so that a long
      // wait takes little of the core the peer may need.
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 5 / 4, std::chrono::microseconds(500));
      const auto waited = Clock::now() - begun;
      if (!logged && waited > first) {
        logged = true;
        log_wait(g, first, "shared-memory exchange", number, waiting_for());
      }
      if (waited >= g.options().timeout)
        fail_wait(g, "shared-memory exchange", number, "still waiting for ranks " + waiting_for());
    }
  }
}

}  // namespace

bool exchange_through_outboxes(const BlockTensors& in, const BlockTensors& out,
                               const ExchangePlan& plan, const Group& group) {
  SharedMemoryLinks& links = group.runtime().links(group);
  if (!links.all_linked()) return false;
  CollectiveRecorder::Scope scope(group.recorder());
  const int P = group.size(), me = group.rank();
  const auto tensors = static_cast<int64_t>(plan.inputs().size());
  TORCH_INTERNAL_ASSERT(tensors < kStages);
  const int64_t n = links.next_exchange(), element = in.tensors[0].element_size();
  const int64_t started = n * kStages;  // kPacked's value once this rank's status is set.

  // 1. Make room for this rank's blocks for its peers, and say where they go.
  const auto send_starts = chunk_starts(plan.send_splits());
  int64_t need = 0;
  for (int j = 0; j < P; ++j)
    if (j != me) need = std::max(need, send_starts[j + 1] * element);
  int error = 0;
  uint8_t* base = need > 0 ? links.outbox(need, error) : nullptr;
  for (int j = 0; j < P; ++j)
    links.publish(SharedMemoryLinks::kChunks + j, send_starts[j] * element);
  // kBytes: the outbox's size, or where it could not grow the size it needed.
  links.publish(SharedMemoryLinks::kBytes, error == 0 ? links.outbox_bytes() : need);
  links.publish(SharedMemoryLinks::kPackError, error);
  links.publish(SharedMemoryLinks::kPacked, started);

  // 2. Every rank has room, or some rank could not make it: all see the lowest.
  wait_for_peers(group, links, SharedMemoryLinks::kPacked, started, scope.number());
  for (int j = 0; j < P; ++j) {
    const int64_t failed = j == me ? error : links.peer_field(j, SharedMemoryLinks::kPackError);
    if (failed == 0) continue;
    const int64_t needed = j == me ? need : links.peer_field(j, SharedMemoryLinks::kBytes);
    links.publish(SharedMemoryLinks::kRead, n);  // (nothing read: no one waits for it)
    for (int k = 0; k < P; ++k) links.drop(k);   // Every rank drops every link, alike.
    TORCH_WARN_ONCE("ulysses: /dev/shm cannot hold a ", needed, "-byte shared-memory outbox (",
                    std::strerror(static_cast<int>(failed)), ") for rank ", j,
                    ": blocks for ranks on this host go as messages or collectives from now on "
                    "(enlarge /dev/shm, or set ULYSSES_SHARED_MEMORY=0 to skip shared memory)");
    return false;
  }

  // 3. Map the outboxes this rank reads: where each peer's blocks for it start.
  const auto recv_starts = chunk_starts(plan.recv_splits());
  std::vector<const uint8_t*> chunk_from(P, nullptr);
  int read_error = 0;
  for (int j = 0; j < P && read_error == 0; ++j) {
    if (j == me || recv_starts[j] == recv_starts[j + 1]) continue;
    const uint8_t* peer =
        links.inbox(j, links.peer_field(j, SharedMemoryLinks::kBytes), read_error);
    if (peer != nullptr)
      chunk_from[j] = peer + links.peer_field(j, SharedMemoryLinks::kChunks + me);
  }

  // 4. Tensor by tensor: pack its blocks, say so, copy the peers' out (one tensor's blocks at a
  // time stay in the cache between the two copies, and a peer's copy-out overlaps the next pack).
  for (int64_t t = 0; t < tensors; ++t) {
    auto of_t = [&](const ExchangeBlock& b) { return b.tensor == t && b.peer != me; };
    pack_blocks(base, 0, plan.send(), in, of_t);
    links.publish(SharedMemoryLinks::kPacked, started + t + 1);
    copy_own_blocks(in, out, plan, me, t);
    if (read_error != 0) continue;  // (still packing: the peers read this rank's blocks)
    wait_for_peers(group, links, SharedMemoryLinks::kPacked, started + t + 1, scope.number());
    for (int j = 0; j < P; ++j) {
      if (chunk_from[j] == nullptr) continue;
      unpack_blocks(chunk_from[j], recv_starts[j], plan, out,
                    [&](const ExchangeBlock& b) { return b.tensor == t && b.peer == j; });
    }
  }
  links.publish(SharedMemoryLinks::kReadError, read_error);
  links.publish(SharedMemoryLinks::kRead, n);

  // 5. Every peer has read this rank's outbox; the lowest rank that could not map one fails all.
  wait_for_peers(group, links, SharedMemoryLinks::kRead, n, scope.number());
  for (int j = 0; j < P; ++j) {
    const int64_t e = j == me ? read_error : links.peer_field(j, SharedMemoryLinks::kReadError);
    TORCH_CHECK(e == 0, "ulysses: rank ", j, " of ", P,
                " cannot map a peer's shared-memory outbox in exchange #", scope.number(), ": ",
                std::strerror(static_cast<int>(e)));
  }
  group.recorder().flag_exchange();
  return true;
}

}  // namespace ulysses
