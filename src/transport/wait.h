// Waiting for c10d work (Note [Waits], group.h), and issuing it without Python state: what every
// collective and point-to-point transfer of the transport floor goes through.
#pragma once

#include <ATen/ThreadLocalPythonObjects.h>
#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "ulysses/group.h"

namespace ulysses {

// Clears this thread's stashed Python objects while a collective is issued. A c10d Work copies
// the issuing thread's state, and every backward stashes a Python object there (autograd's
// contextvars context). The backend's worker thread often drops the last reference to a Work,
// and the decref then needs the GIL; at interpreter exit that thread is ended inside a noexcept
// destructor, and the process aborts ("terminate called without an active exception"). Without
// Python objects (and with tensors from for_work below) a Work never touches the GIL.
class NoPythonObjectsInWork {
 public:
  NoPythonObjectsInWork() : saved_(at::impl::ThreadLocalPythonObjects::get_state()) {
    at::impl::ThreadLocalPythonObjects::set_state({});
  }
  ~NoPythonObjectsInWork() { at::impl::ThreadLocalPythonObjects::set_state(std::move(saved_)); }
  NoPythonObjectsInWork(const NoPythonObjectsInWork&) = delete;
  NoPythonObjectsInWork& operator=(const NoPythonObjectsInWork&) = delete;

 private:
  at::impl::ThreadLocalPythonObjects saved_;
};

// What a collective is handed in place of `t`: the same memory under a TensorImpl of its own,
// without autograd (no view base). A tensor Python ever saw owns its Python object once Python
// lets go of it, so a Work holding the caller's tensor (or a view of it) would, on the worker
// thread that drops the Work last, free that object and take the GIL: the abort above, seen
// at exit after a sum_over_group whose result Python had just dropped.
inline at::Tensor for_work(const at::Tensor& t) { return t.variable_data(); }

// Whether a wait for work on `device` tensors is timed and logged on the host (CPU tensors:
// GroupOptions::timeout), or left to the stream and the process group (Note [Waits]).
inline bool waits_on_host(c10::DeviceType device) { return device == c10::DeviceType::CPU; }

// `t` in seconds, one decimal: how slow waits are logged.
std::string seconds(std::chrono::milliseconds t);

// What every wait of the transport shares, the collectives' (wait below) and the shared-memory
// flags' (Note [Flag handshake]): when a slow wait is logged, the log line, the failure.
//
// How long a wait goes before it is logged: GroupOptions::log_wait_fraction of the timeout, or
// the whole timeout (never logged) when the fraction is not in (0, 1).
std::chrono::milliseconds log_wait_after(const Group& g);
// The other ranks of `g` that `waiting(rank)` picks, as "1, 3".
std::string ranks_where(const Group& g, const std::function<bool(int)>& waiting);
// Logs that this rank has waited `waited` in `op` #`number` of `g` for ranks `peers` (c10
// logging, not TORCH_WARN: under Python a TORCH_WARN is held until the op returns, and this line
// matters while the op is stuck; TORCH_CPP_LOG_LEVEL=ERROR silences it).
void log_wait(const Group& g, std::chrono::milliseconds waited, const std::string& op,
              int64_t number, const std::string& peers);
// Raises that `op` #`number` of `g` failed on this rank, and `what` (the backend's error, or the
// ranks still waited for).
[[noreturn]] void fail_wait(const Group& g, const std::string& op, int64_t number,
                            const std::string& what);

// Waits for `work` (collective number `number` of `g`, named `op`), turning a backend failure
// into an error that says where it happened. A wait longer than GroupOptions::
// log_wait_fraction of the timeout is logged once, naming the collective, its number on this
// group and the peers it needs (for an all-to-all, those it exchanges a non-empty chunk with:
// `out_splits` and `in_splits`): with a frozen or lagging rank every other rank says what it is
// stuck in long before the timeout ends the job. Device tensors (Note [Waits]): the wait orders
// the current stream after the work and returns; the process group enforces its own timeout.
void wait(const Group& g, const char* op, const c10::intrusive_ptr<c10d::Work>& work,
          int64_t number, c10::DeviceType device, const std::vector<int64_t>* out_splits = nullptr,
          const std::vector<int64_t>* in_splits = nullptr);

}  // namespace ulysses
