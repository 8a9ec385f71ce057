#include "transport/transfers.h"

#include <c10/util/Exception.h>

#include <chrono>

#include "transport/environment.h"
#include "transport/wait.h"
#include "ulysses/collective_recorder.h"

namespace ulysses {

// Through getDeviceTypes, which every supported torch has (2.11's ProcessGroup lacks
// hasBackendForDeviceType).
bool has_backend(const c10d::ProcessGroup& pg, c10::DeviceType device) {
  for (const c10::Device& d : pg.getDeviceTypes())
    if (d.type() == device) return true;
  return false;
}

namespace {

// Whether `pg`'s backend for `device` posts point-to-point transfers as coalesced groups.
bool coalesces(c10d::ProcessGroup& pg, c10::DeviceType device) {
  return has_backend(pg, device) && pg.getBackend(device)->supportsCoalescing();
}

}  // namespace

bool batches(const Group& group, c10::DeviceType device) {
  // Off the CPU, unbatched point-to-point is never safe (NCCL runs it in posting order: a
  // receive posted before its peer's send waits forever), whatever the options say.
  if (device != c10::DeviceType::CPU) return true;
  GroupOptions::Transport transport = group.options().transport;
  if (transport == GroupOptions::Transport::kAuto)
    transport = transport_from_environment().value_or(GroupOptions::Transport::kAuto);
  switch (transport) {
    case GroupOptions::Transport::kMessages:
      return false;
    case GroupOptions::Transport::kBatched:
      return true;
    default:  // Where the backend coalesces, it needs it (NCCL).
      return group.process_group() && coalesces(*group.process_group(), device);
  }
}

Transfers::Transfers(const Group& group, c10::DeviceType device)
    : group_(group), device_(device), batched_(batches(group, device)) {
  TORCH_CHECK_VALUE(group.process_group(), "Transfers: point-to-point needs a multi-rank group");
  coalesced_ = batched_ && coalesces(*group.process_group(), device);
  number_ = group.recorder().next_message();
}

Transfers::~Transfers() {
  try {
    wait();
  } catch (...) {  // Its error was, or will be, raised elsewhere.
  }
}

void Transfers::send(const at::Tensor& t, int to, int tag) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && to >= 0 && to < group_.size() && to != group_.rank());
  transfers_.push_back({t, to, tag, true, {}});
  group_.recorder().sent(static_cast<int64_t>(t.nbytes()));
  if (!batched_) post();
}

size_t Transfers::receive(const at::Tensor& t, int from, int tag) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && from >= 0 && from < group_.size() &&
                        from != group_.rank());
  transfers_.push_back({t, from, tag, false, {}});
  if (!batched_) post();
  return transfers_.size() - 1;
}

void Transfers::post(Transfer& t) {
  std::vector<at::Tensor> tensors{for_work(t.tensor)};
  const auto& pg = group_.process_group();
  t.work = t.send ? pg->send(tensors, t.peer, t.tag) : pg->recv(tensors, t.peer, t.tag);
}

void Transfers::post() {
  if (posted_ == transfers_.size()) return;
  NoPythonObjectsInWork no_python;
  const auto& pg = group_.process_group();
  if (coalesced_) pg->startCoalescing(device_);
  for (size_t i = posted_; i < transfers_.size(); ++i) post(transfers_[i]);
  if (coalesced_) {
    // One work for the group: each transfer waits on it (the first wait clears them all).
    c10::intrusive_ptr<c10d::Work> work = pg->endCoalescing(device_);
    for (size_t i = posted_; i < transfers_.size(); ++i) transfers_[i].work = work;
  }
  posted_ = transfers_.size();
}

void Transfers::wait(size_t n) {
  post();
  const c10::intrusive_ptr<c10d::Work> work = std::move(transfers_.at(n).work);
  if (!work) return;
  if (coalesced_) {  // The others of its group share it: waited once.
    for (Transfer& t : transfers_)
      if (t.work == work) t.work.reset();
  }
  // Time blocked here is communication not hidden behind work: counted with the collectives'.
  const auto t0 = std::chrono::steady_clock::now();
  ulysses::wait(group_, "point-to-point", work, number_, device_);
  group_.recorder().waited(std::chrono::steady_clock::now() - t0);
}

void Transfers::wait() {
  for (size_t i = 0; i < transfers_.size(); ++i) wait(i);
  transfers_.clear();
  posted_ = 0;
}

}  // namespace ulysses
