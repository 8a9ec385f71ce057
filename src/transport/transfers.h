// Point-to-point transfers between the ranks of a Group, posted as its transport says
// (GroupOptions::transport): what the ring and the projected and pipelined exchanges move by.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "ulysses/group.h"

namespace ulysses {

// Whether `pg` has a backend for `device` tensors.
bool has_backend(const c10d::ProcessGroup& pg, c10::DeviceType device);

// Whether point-to-point transfers of `device` tensors on `group` go batched: the one place the
// transport is chosen. Off the CPU always (unbatched point-to-point is never safe there); on CPU
// tensors the options' transport (kAuto: ULYSSES_TRANSPORT when set, else batched where the
// backend coalesces).
bool batches(const Group& group, c10::DeviceType device);

// The point-to-point transfers of one step (a ring step's key/value blocks, a projected
// exchange's slabs), posted as the group's transport says (GroupOptions::transport): messages
// go out as they are added, so packing the next overlaps this one's transfer; batched ones
// wait for post() and go together. Callers add every transfer of the step, call post(), and
// wait; code written so runs unchanged on both. Transfers of one tag between two ranks arrive
// in order, and both ranks add their transfers between them in the same order (NCCL ignores
// tags). A Transfers that dies unwaited waits in its destructor, so buffers never go while
// the backend still uses them.
class Transfers {
 public:
  Transfers(const Group& group, c10::DeviceType device);
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;
  ~Transfers();
  // A send of `t` (contiguous; kept alive until done) to rank `to`.
  void send(const at::Tensor& t, int to, int tag);
  // A receive into `t` (contiguous) from rank `from`; returns its number for wait(n).
  size_t receive(const at::Tensor& t, int from, int tag);
  // Posts what batching held back. Messages went out already.
  void post();
  // Waits for transfer `n` (posting first), each wait at most the group's timeout on CPU.
  void wait(size_t n);
  // Waits for every transfer.
  void wait();
  bool batched() const { return batched_; }

 private:
  struct Transfer {
    at::Tensor tensor;
    int peer;
    int tag;
    bool send;
    c10::intrusive_ptr<c10d::Work> work;  // Null until posted, and again once waited.
  };
  void post(Transfer& t);
  Group group_;
  c10::DeviceType device_;
  bool batched_;
  size_t posted_ = 0;       // Transfers [0, posted_) are posted.
  bool coalesced_ = false;  // Batched, on a backend that coalesces: a post shares one work.
  std::vector<Transfer> transfers_;
  int64_t number_ = 0;  // The first transfer's number among the group's point-to-point sends.
};

}  // namespace ulysses
