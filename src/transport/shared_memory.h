// Ranks of one host exchanging through shared memory (GroupOptions::shared_memory).
//
// Each rank owns an outbox, a file in /dev/shm that its co-located peers map: a sender packs its
// blocks for them straight into it and they copy the blocks out, two copies where a transfer over
// TCP loopback takes four (pack, the kernel's send and receive, unpack). An outbox opens with a
// control page: the flags exchanges between ranks all on one host hand over with, through two
// windows of bounded size (Note [Flag handshake] in shared_exchange.cpp). Where only some ranks
// share a host, the pipelined exchange's notices hand over instead (shared_transfer.h), and the
// outbox holds a whole exchange's blocks for those peers. Ranks are co-located when
// they share the boot, the /dev/shm file system and the network namespace (test hosts in
// namespaces, scripts/netns_hosts.sh, stay apart). An outbox's name is unlinked once every peer
// has opened it, so a process that dies leaves nothing behind.
#pragma once

#include <cstdint>
#include <vector>

namespace ulysses {
class Group;
}

namespace ulysses::detail {

// This boot's identity (a hash of its boot_id; 0 where it cannot be read), read once: ranks with
// the same key share steady_clock and may share memory.
int64_t boot_key();

class SharedMemoryLinks {
 public:
  // Creates this rank's (empty) outbox and opens its co-located peers': two all_gathers, which
  // every rank of `group` issues at the same point (its first exchange with the option on).
  explicit SharedMemoryLinks(const Group& group);
  ~SharedMemoryLinks();
  SharedMemoryLinks(const SharedMemoryLinks&) = delete;
  SharedMemoryLinks& operator=(const SharedMemoryLinks&) = delete;

  // True when blocks to and from `peer` go through shared memory (alike on both ranks).
  bool colocated(int peer) const { return colocated_[peer]; }
  // True when every rank of the group is linked with every other: alike on every rank (the
  // links' matrix is all-gathered), until a link is dropped (on every rank in the same exchange:
  // each is linked with the rank that drops its links) or flag exchanges stop.
  bool all_linked() const { return all_linked_; }
  // From the next exchange on, blocks to and from `peer` go as messages. Both ranks of a link
  // drop it in the same exchange: the one whose outbox failed, and the peer its notice told.
  void drop(int peer) {
    colocated_[peer] = false;
    all_linked_ = false;
  }
  // Exchanges stop handing over with flags (Note [Flag handshake]), as when some rank is on
  // another host: every rank in the same exchange (the tests' way to reach the pipelined path).
  void stop_flag_exchanges() { all_linked_ = false; }
  // This rank's outbox with room for at least `bytes` (> 0) past its control page, grown when
  // smaller, its pages reserved so that a full /dev/shm is an error here rather than a SIGBUS
  // later. On failure returns null and sets `error` to the errno.
  uint8_t* outbox(int64_t bytes, int& error);
  int64_t outbox_bytes() const { return mine_.bytes - control_bytes_; }
  // `peer`'s outbox, mapped anew when it grew beyond what this rank mapped (`bytes`: its size as
  // the peer's notice or control page gave it). On failure returns null and sets `error` to the
  // errno.
  const uint8_t* inbox(int peer, int64_t bytes, int& error);

  // The control page's fields (Note [Flag handshake]). This rank writes its own, and reads its
  // peers' (mapped read-only).
  enum Field : int {
    kPacked = 0,      // The exchange and round whose blocks this rank packed (or failed to).
    kRead = 8,        // The last exchange whose blocks this rank read from every peer.
    kBytes = 16,      // The outbox's bytes past the control page, when kPacked was set.
    kPackError = 17,  // The errno of a failure to make room, for kPacked's exchange; 0: none.
    kReadError = 18,  // The errno of a failure to map a peer's outbox, for kRead's; 0: none.
    kSlot = 19,       // The bytes of each peer's slot in a window of the outbox.
    kRounds = 20,     // The rounds this rank's blocks for its busiest peer take.
    kFields = 21,
  };
  // Stores `value` in this rank's field; kPacked and kRead with release order (set last).
  void publish(int field, int64_t value);
  // `peer`'s field; kPacked and kRead with acquire order (read first).
  int64_t peer_field(int peer, int field) const;
  // The next small exchange's number: alike on every rank (all issue them in one order).
  int64_t next_exchange() { return ++exchanges_; }

 private:
  struct Mapping {
    int fd = -1;
    void* p = nullptr;
    int64_t bytes = 0;
  };
  static int map(Mapping& m, int64_t bytes, bool writable);  // An errno, 0 when mapped.
  int64_t* field(Mapping& m, int f) const { return static_cast<int64_t*>(m.p) + f; }
  std::vector<bool> colocated_;
  bool all_linked_ = false;
  int64_t control_bytes_ = 0;  // A whole number of pages, room for kFields.
  int64_t exchanges_ = 0;
  Mapping mine_;
  std::vector<Mapping> peers_;
};

}  // namespace ulysses::detail
