// The blocks of an exchange to and from co-located ranks, through their shared-memory outboxes
// (GroupOptions::shared_memory; the links in shared_memory.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "transport/exchange_blocks.h"
#include "transport/group_runtime.h"
#include "transport/message_tags.h"
#include "transport/shared_memory.h"
#include "transport/transfers.h"
#include "transport/wire.h"
#include "ulysses/exchange_plan.h"
#include "ulysses/group.h"

namespace ulysses {

// The blocks of `plan` to and from co-located peers, through their shared-memory outboxes
// (GroupOptions::shared_memory). Each block sits in its sender's outbox where it would sit in
// the flat send buffer of one collective. post() packs this rank's blocks into its outbox and
// sends each co-located peer a notice: where that peer's blocks start, the outbox's size, and
// the errno of a failure to make room. finish() copies each peer's blocks out as its notice
// comes, tells it so, and waits until every peer has read this rank's (the outbox is then free
// for the next exchange). A rank whose outbox cannot grow (/dev/shm full) says so in its notices
// and sends its blocks for each co-located peer as one message instead; both ends then drop the
// link, so later exchanges between them go as messages (one warning, on the rank that fell
// back). A failure to map a peer's outbox completes the handshake first, then every co-located
// rank raises the lowest failing rank's error.
class SharedTransfer {
 public:
  SharedTransfer(const BlockTensors& in, const BlockTensors& out, const ExchangePlan& plan,
                 const Group& group)
      : in_(in),
        out_(out),
        plan_(plan),
        group_(group),
        links_(group.runtime().links(group)),
        io_(group, c10::DeviceType::CPU),
        element_(in.tensors[0].element_size()) {
    for (int j = 0; j < group.size(); ++j)
      if (j != group.rank() && links_.colocated(j)) peers_.push_back(j);
  }
  bool colocated(int peer) const { return links_.colocated(peer); }

  void post() {
    for (int j : peers_) {
      notices_.push_back(at::empty({4}, at::kLong));
      packed_.push_back(io_.receive(notices_.back(), j, detail::kSharedMemoryPacked));
      io_.receive(at::empty({1}, at::kLong), j, detail::kSharedMemoryRead);
    }
    const auto starts = chunk_starts(plan_.send_splits());
    int64_t need = 0;  // Bytes up to the end of the last co-located peer's chunk.
    for (int j : peers_) need = std::max(need, starts[j + 1] * element_);
    int error = 0;
    uint8_t* base = need > 0 ? links_.outbox(need, error) : nullptr;
    if (base != nullptr)
      pack_blocks(base, 0, plan_.send(), in_,
                  [&](const ExchangeBlock& b) { return colocated(b.peer); });
    for (int j : peers_) {
      io_.send(
          at::tensor(std::vector<int64_t>{starts[j] * element_, links_.outbox_bytes(), error, need},
                     at::kLong),
          j, detail::kSharedMemoryPacked);
    }
    if (error != 0) fall_back(starts, need, error);
  }

  void finish() {
    const auto starts = chunk_starts(plan_.recv_splits());
    for (size_t i = 0; i < peers_.size(); ++i) {
      const int j = peers_[i];
      io_.wait(packed_[i]);
      const int64_t* n = notices_[i].data_ptr<int64_t>();  // chunk offset, size, errno, need
      if (n[2] != 0) {  // No outbox there: its blocks come as one message.
        receive_from(j, starts[j], starts[j + 1]);
        dropped_.push_back(j);
      } else if (failures_.empty()) {
        copy_from(j, n[0], n[1], starts[j], starts[j + 1]);
      }
      io_.send(at::zeros({1}, at::kLong), j, detail::kSharedMemoryRead);
    }
    io_.wait();
    // Only now: this exchange chose messages or shared memory per peer before it began.
    for (int j : dropped_) links_.drop(j);
    TORCH_CHECK(failures_.empty(), failures_.begin()->second);
  }

 private:
  // Copies `peer`'s blocks for this rank (elements [recv_start, recv_end) of the flat receive
  // buffer) out of its outbox, where they start at byte `chunk`.
  void copy_from(int peer, int64_t chunk, int64_t outbox_bytes, int64_t recv_start,
                 int64_t recv_end) {
    if (recv_start == recv_end) return;  // Nothing from it (it may have no outbox at all).
    int error = 0;
    const uint8_t* base = links_.inbox(peer, outbox_bytes, error);
    if (base == nullptr) {
      failures_.emplace(group_.rank(), "ulysses: rank " + std::to_string(group_.rank()) +
                                           " cannot map rank " + std::to_string(peer) +
                                           "'s shared-memory outbox: " + std::strerror(error));
      return;
    }
    put_blocks_from(peer, base + chunk, recv_start);
  }
  // Puts `peer`'s blocks for this rank in place from `base`, where the flat receive buffer's
  // element `recv_start` sits.
  void put_blocks_from(int peer, const uint8_t* base, int64_t recv_start) {
    unpack_blocks(base, recv_start, plan_, out_,
                  [&](const ExchangeBlock& b) { return b.peer == peer; });
  }
  // This rank's outbox cannot hold `need` bytes: sends each co-located peer its chunk of the flat
  // send buffer as one message, and drops the links after this exchange.
  void fall_back(const std::vector<int64_t>& starts, int64_t need, int error) {
    TORCH_WARN_ONCE("ulysses: /dev/shm cannot hold a ", need, "-byte shared-memory outbox (",
                    std::strerror(error),
                    "): blocks for ranks on this host go as messages from now on (enlarge "
                    "/dev/shm, or set ULYSSES_SHARED_MEMORY=0 to skip shared memory)");
    for (int j : peers_) {
      dropped_.push_back(j);
      if (starts[j] == starts[j + 1]) continue;
      at::Tensor chunk = group_.new_buffer({starts[j + 1] - starts[j]}, in_.tensors[0].options());
      pack_blocks(static_cast<uint8_t*>(chunk.data_ptr()), starts[j], plan_.send(), in_,
                  [&](const ExchangeBlock& b) { return b.peer == j; });
      io_.send(detail::wire_view(chunk), j, detail::kSharedMemoryFallback);
      sent_.push_back(std::move(chunk));  // Alive until the sends complete (finish).
    }
  }
  // `peer`'s blocks for this rank as one message (elements [recv_start, recv_end) of the flat
  // receive buffer), sent because its outbox could not grow.
  void receive_from(int peer, int64_t recv_start, int64_t recv_end) {
    if (recv_start == recv_end) return;
    at::Tensor chunk = group_.new_buffer({recv_end - recv_start}, out_.tensors[0].options());
    io_.wait(io_.receive(detail::wire_view(chunk), peer, detail::kSharedMemoryFallback));
    put_blocks_from(peer, static_cast<const uint8_t*>(chunk.data_ptr()), recv_start);
  }

  const BlockTensors& in_;
  const BlockTensors& out_;
  const ExchangePlan& plan_;
  const Group& group_;
  detail::SharedMemoryLinks& links_;
  Transfers io_;  // Notices; posted as added (the pipelined path is never batched).
  const int64_t element_;
  std::vector<int> peers_;  // Co-located, in rank order.
  std::vector<at::Tensor> notices_;
  std::vector<size_t> packed_;           // The notices' receives.
  std::map<int, std::string> failures_;  // By failing rank.
  std::vector<int> dropped_;             // Links dropped after this exchange.
  std::vector<at::Tensor> sent_;         // Chunks sent as messages (fall_back).
};

}  // namespace ulysses
