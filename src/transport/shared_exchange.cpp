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
// notices (docs/benchmarks.md), which serve groups spread over hosts.
//
// An outbox holds two windows, each a slot per peer of about GroupOptions::message_bytes /
// (P - 1) (at least one token of any block; none for the rank itself, whose blocks are copied
// straight across), so its memory is bounded whatever the exchange's size: a
// rank's blocks for a peer go as the pieces the pipelined path would cut (messages(), over every
// batch entry), filled in order into slots, round after round. Exchange number n (alike on
// every rank):
//  1. each rank computes its slot (kSlot) and how many rounds its blocks for its busiest peer
//     take (kRounds), makes room for both windows, sets kBytes and kPackError (the errno of a
//     failure to make room), then kPacked = n * kStages;
//  2. waits until every peer's kPacked reaches that. A rank that could not make room is seen by
//     every rank here: all return false (the caller runs the exchange another way) and drop every
//     link for good (later exchanges go as messages or collectives). Every rank runs the largest
//     kRounds, R;
//  3. maps the outboxes it reads (anew where one grew);
//  4. round r of R: packs its pieces of round r into window r % 2, sets kPacked = n * kStages +
//     r + 1, waits until every peer's kPacked reaches that, and copies the peers' pieces of
//     round r out. A round's blocks stay in the cache between pack and copy, and a peer's
//     copy-out overlaps the next round's pack. Window r % 2 is free again by then with no other
//     wait: a peer packed round r - 1 only after reading round r - 2;
//  5. sets kReadError, then kRead = n * kStages + R, and waits until every peer's kRead reaches
//     that: no one reads its outbox any more, so the next exchange may overwrite it. A failure to
//     map a peer's outbox raises the lowest failing rank's error on every rank.
// kPacked and kRead are stored with release order and loaded with acquire order, so the blocks
// and fields written before them are seen after them. A wait yields a while, then naps, longer
// and longer (ranks may outnumber cores); past GroupOptions::log_wait_fraction of the timeout it
// logs, past the timeout it raises, naming the exchange and the ranks it waits for, as a
// collective's wait does (wait.h).
namespace {

using detail::SharedMemoryLinks;

// kPacked counts rounds from exchange * kStages; kRead is exchange * kStages + R once read.
constexpr int64_t kStages = int64_t{1} << 32;

// Waits until every peer's `field` is at least `n` (Note [Flag handshake]).
void wait_for_peers(const Group& g, const SharedMemoryLinks& links, int field, int64_t n,
                    int64_t number) {
  using Clock = std::chrono::steady_clock;
  const auto begun = Clock::now();
  const auto first = log_wait_after(g);
  bool logged = first == g.timeout();
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
      if (waited >= g.timeout())
        fail_wait(g, "shared-memory exchange", number, "still waiting for ranks " + waiting_for());
    }
  }
}

// Where `to`'s slot sits in a window of `from`'s outbox: one slot per peer, none for itself.
int64_t slot_index(int to, int from) { return to < from ? to : to - 1; }

// The pieces to or from one peer, by round: where each sits in its slot.
struct Rounds {
  std::vector<Message> pieces;
  std::vector<int64_t> round, at;  // Per piece; `at` in elements from the slot's start.
  int64_t count = 0;
};

// `pieces` filled in order into slots of `slot` elements, a new round where one is full. Both
// ends of a link fill mirrored pieces alike (with the sender's slot).
Rounds fill(std::vector<Message> pieces, int64_t slot) {
  Rounds r{std::move(pieces), {}, {}, 0};
  int64_t used = slot;
  for (const Message& m : r.pieces) {
    if (used + m.numel > slot) {
      r.count += 1;
      used = 0;
    }
    r.round.push_back(r.count - 1);
    r.at.push_back(used);
    used += m.numel;
  }
  return r;
}

}  // namespace

bool exchange_through_outboxes(const BlockTensors& in, const BlockTensors& out,
                               const ExchangePlan& plan, const Group& group) {
  SharedMemoryLinks& links = group.runtime().links(group);
  if (!links.all_linked()) return false;
  CollectiveRecorder::Scope scope(group.recorder());
  const int P = group.size(), me = group.rank();
  const int64_t n = links.next_exchange(), element = in.tensors[0].element_size();
  const int64_t started = n * kStages;  // kPacked's value once this rank's status is set.

  // 1. This rank's slot: its share of message_bytes, and at least a token of any block it sends.
  // Pieces span every batch entry: each is copied into its slot, never received in place, so it
  // need not be contiguous where it lies (fewer, larger copies).
  const int64_t peers = std::max(1, P - 1);  // (a group of one has no pieces to hand over)
  int64_t slot = std::max<int64_t>(1, group.options().message_bytes / peers / element);
  for (const ExchangeBlock& b : plan.send())
    if (b.numel > 0) slot = std::max(slot, b.numel / b.tokens.size());
  std::vector<Rounds> to(P), from(P);
  int64_t rounds = 0;
  for (int j = 0; j < P; ++j) {
    if (j == me) continue;
    to[j] = fill(messages(plan.send(), j, slot, 1), slot);
    rounds = std::max(rounds, to[j].count);
  }
  const int64_t need = 2 * peers * slot * element;
  int error = 0;
  uint8_t* base = links.outbox(need, error);
  links.publish(SharedMemoryLinks::kSlot, slot * element);
  links.publish(SharedMemoryLinks::kRounds, rounds);
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
    for (int k = 0; k < P; ++k) links.drop(k);  // Every rank drops every link, alike.
    TORCH_WARN_ONCE("ulysses: /dev/shm cannot hold a ", needed, "-byte shared-memory outbox (",
                    std::strerror(static_cast<int>(failed)), ") for rank ", j,
                    ": blocks for ranks on this host go as messages or collectives from now on "
                    "(enlarge /dev/shm, or set ULYSSES_SHARED_MEMORY=0 to skip shared memory)");
    return false;
  }
  for (int j = 0; j < P; ++j)
    if (j != me) rounds = std::max(rounds, links.peer_field(j, SharedMemoryLinks::kRounds));
  TORCH_INTERNAL_ASSERT(rounds < kStages);

  // 3. Map the outboxes this rank reads, and cut what each peer sends it as the peer did.
  std::vector<const uint8_t*> inbox(P, nullptr);
  std::vector<int64_t> peer_slot(P, 0);
  int read_error = 0;
  for (int j = 0; j < P && read_error == 0; ++j) {
    if (j == me || plan.recv_splits()[j] == 0) continue;
    inbox[j] = links.inbox(j, links.peer_field(j, SharedMemoryLinks::kBytes), read_error);
    peer_slot[j] = links.peer_field(j, SharedMemoryLinks::kSlot) / element;
    from[j] = fill(messages(plan.recv(), j, peer_slot[j], 1), peer_slot[j]);
  }

  // 4. Round by round: pack, say so, copy the peers' pieces out. Pieces come in round order:
  // each peer's cursor walks them once.
  std::vector<size_t> packed(P, 0), read(P, 0);
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t window = r % 2;
    for (int j = 0; j < P; ++j) {
      for (size_t& i = packed[j]; i < to[j].pieces.size() && to[j].round[i] == r; ++i) {
        const Message& m = to[j].pieces[i];
        const at::Tensor src = in.view(*m.block, m.batch, m.first, m.count);
        uint8_t* at = base + ((window * peers + slot_index(j, me)) * slot + to[j].at[i]) * element;
        at::from_blob(at, src.sizes(), src.options()).copy_(src);
      }
    }
    links.publish(SharedMemoryLinks::kPacked, started + r + 1);
    if (r == 0) copy_own_blocks(in, out, plan, me);
    // (Waited for even where this rank reads nothing: the windows' reuse rests on the lockstep.)
    wait_for_peers(group, links, SharedMemoryLinks::kPacked, started + r + 1, scope.number());
    if (read_error != 0) continue;  // (still packing: the peers read this rank's blocks)
    for (int j = 0; j < P; ++j) {
      for (size_t& i = read[j]; i < from[j].pieces.size() && from[j].round[i] == r; ++i) {
        const Message& m = from[j].pieces[i];
        const at::Tensor dst = out.view(*m.block, m.batch, m.first, m.count);
        const uint8_t* at =
            inbox[j] +
            ((window * peers + slot_index(me, j)) * peer_slot[j] + from[j].at[i]) * element;
        put_block(dst, at::from_blob(const_cast<uint8_t*>(at), dst.sizes(), dst.options()), out,
                  plan);
      }
    }
  }
  if (rounds == 0) copy_own_blocks(in, out, plan, me);
  links.publish(SharedMemoryLinks::kReadError, read_error);
  links.publish(SharedMemoryLinks::kRead, started + rounds);

  // 5. Every peer has read this rank's outbox; the lowest rank that could not map one fails all.
  wait_for_peers(group, links, SharedMemoryLinks::kRead, started + rounds, scope.number());
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
