// Ranks of one host exchanging through shared memory (GroupOptions::shared_memory).
//
// Each rank owns an outbox, a file in /dev/shm that its co-located peers map: a sender packs its
// blocks for them straight into it and they copy the blocks out, two copies where a transfer over
// TCP loopback takes four (pack, the kernel's send and receive, unpack). Ranks are co-located
// when they share the boot, the /dev/shm file system and the network namespace (test hosts in
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
  // From the next exchange on, blocks to and from `peer` go as messages. Both ranks of a link
  // drop it in the same exchange: the one whose outbox failed, and the peer its notice told.
  void drop(int peer) { colocated_[peer] = false; }
  // This rank's outbox with room for at least `bytes` (> 0), grown when smaller, its pages
  // reserved so that a full /dev/shm is an error here rather than a SIGBUS later. On failure
  // returns null and sets `error` to the errno.
  uint8_t* outbox(int64_t bytes, int& error);
  int64_t outbox_bytes() const { return mine_.bytes; }
  // `peer`'s outbox, mapped anew when it grew beyond what this rank mapped (`bytes`: its size as
  // the peer's notice gave it). On failure returns null and sets `error` to the errno.
  const uint8_t* inbox(int peer, int64_t bytes, int& error);

 private:
  struct Mapping {
    int fd = -1;
    void* p = nullptr;
    int64_t bytes = 0;
  };
  static int map(Mapping& m, int64_t bytes, bool writable);  // An errno, 0 when mapped.
  std::vector<bool> colocated_;
  Mapping mine_;
  std::vector<Mapping> peers_;
};

}  // namespace ulysses::detail
