// What a process group's communication costs, recorded beside the collective path (as c10d
// keeps its flight recorder beside ProcessGroupNCCL): collectives issued, the wall time inside
// them and blocked on point-to-point transfers, point-to-point messages and bytes sent, and, on
// request, when each collective began and ended. One recorder per process group, shared by every
// Group handle of it (Group::recorder()); the training log and the benchmarks read it.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace ulysses {

class Group;

class CollectiveRecorder {
 public:
  // Collectives issued (an agreement counts once per round).
  int64_t collectives() const { return collectives_.load(); }
  // Wall-clock seconds inside collectives and blocked waiting for point-to-point transfers
  // (what no work hid).
  double seconds() const { return static_cast<double>(nanoseconds_.load()) * 1e-9; }
  // Point-to-point messages and bytes this rank sent.
  int64_t p2p_messages() const { return p2p_messages_.load(); }
  int64_t p2p_bytes() const { return p2p_bytes_.load(); }
  // Of the collectives, exchanges handed over through shared memory with no message (small ones
  // between ranks of one host: Note [Flag handshake], src/transport/shared_exchange.cpp).
  int64_t flag_exchanges() const { return flag_exchanges_.load(); }
  void flag_exchange() { flag_exchanges_ += 1; }
  // Kernels of recomputed head chunks that ran on another thread while this group's next
  // exchange ran (Note [Overlapped chunks], partition.h).
  int64_t overlapped_kernels() const { return overlapped_kernels_.load(); }
  void overlapped_kernel() { overlapped_kernels_ += 1; }

  // From now on, keeps when each collective begins and ends, dropping what was kept (Note
  // [Waiting for the last rank] in src/transport/collective_recorder.cpp).
  void keep_times();
  // Of this rank's collectives kept since then, the seconds spent waiting for the group's last
  // rank to arrive; keeping starts anew. Two all_gathers over `group` (this recorder's), which
  // every rank issues alike; nullopt when the ranks do not share a clock (another host) or did
  // not keep the same collectives.
  std::optional<double> take_waiting_seconds(const Group& group);

  // One collective, from construction to destruction: counted, timed and (when kept) its times
  // kept. number() is its number on the group (1 for the first), as slow waits log it.
  class Scope {
   public:
    explicit Scope(CollectiveRecorder& recorder);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    int64_t number() const { return number_; }

   private:
    CollectiveRecorder& recorder_;
    const int64_t number_;
    const std::chrono::steady_clock::time_point begun_;
  };
  // A point-to-point send of `bytes`.
  void sent(int64_t bytes) {
    p2p_messages_ += 1;
    p2p_bytes_ += bytes;
  }
  // Time blocked waiting for point-to-point transfers.
  void waited(std::chrono::nanoseconds blocked) { nanoseconds_ += blocked.count(); }
  // The number the next point-to-point message will have.
  int64_t next_message() const { return p2p_messages_.load() + 1; }

 private:
  // One kept collective: its number and when it began and ended (steady_clock nanoseconds).
  struct Times {
    int64_t number = 0;
    int64_t begun = 0;
    int64_t ended = 0;
    bool operator<(const Times& other) const { return number < other.number; }
  };
  std::atomic<int64_t> collectives_{0};
  std::atomic<int64_t> nanoseconds_{0};
  std::atomic<int64_t> p2p_messages_{0};
  std::atomic<int64_t> p2p_bytes_{0};
  std::atomic<int64_t> overlapped_kernels_{0};
  std::atomic<int64_t> flag_exchanges_{0};
  std::atomic<bool> keep_times_{false};
  std::mutex times_mu_;
  std::vector<Times> times_;  // Guarded by times_mu_; in order of ending.
};

}  // namespace ulysses
