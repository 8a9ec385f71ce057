#include "ulysses/collective_recorder.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "transport/shared_memory.h"
#include "ulysses/group.h"

namespace ulysses {

CollectiveRecorder::Scope::Scope(CollectiveRecorder& recorder)
    : recorder_(recorder),
      number_(++recorder.collectives_),
      begun_(std::chrono::steady_clock::now()) {}

CollectiveRecorder::Scope::~Scope() {
  const auto ended = std::chrono::steady_clock::now();
  recorder_.nanoseconds_ +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(ended - begun_).count();
  if (recorder_.keep_times_.load()) {
    std::lock_guard<std::mutex> lock(recorder_.times_mu_);
    recorder_.times_.push_back(
        {number_, begun_.time_since_epoch().count(), ended.time_since_epoch().count()});
  }
}

// Note [Waiting for the last rank]
// A collective cannot finish before its last rank arrives, so a rank's wall time inside it is
// the wait for that rank plus the transfer itself. The wait says nothing about the transport: it
// is a straggler, or, with more ranks than cores, a rank that has no core yet. Splitting the two
// takes every rank's arrival times on one clock: steady_clock is the boot's monotonic clock, so
// ranks that share a boot compare them directly, and ranks on other hosts get no split.
void CollectiveRecorder::keep_times() {
  std::lock_guard<std::mutex> lock(times_mu_);
  times_.clear();
  keep_times_ = true;
}

std::optional<double> CollectiveRecorder::take_waiting_seconds(const Group& group) {
  std::vector<Times> times;
  {
    std::lock_guard<std::mutex> lock(times_mu_);
    times.swap(times_);
  }
  std::sort(times.begin(), times.end());  // By number: threads may end them out of order.
  const auto n = static_cast<int64_t>(times.size());
  const int64_t host = detail::boot_key();
  const at::Tensor keys =
      group.all_gather(at::tensor({host, n, times.empty() ? int64_t{0} : times[0].number}));
  for (int r = 0; r < group.size(); ++r) {  // Another boot, or other collectives: no common clock.
    if (keys[r][0].item<int64_t>() != host || host == 0 || keys[r][1].item<int64_t>() != n ||
        keys[r][2].item<int64_t>() != keys[0][2].item<int64_t>()) {
      return std::nullopt;
    }
  }
  if (n == 0) return 0.0;
  std::vector<int64_t> begun;
  for (const Times& t : times) begun.push_back(t.begun);
  const at::Tensor last = std::get<0>(group.all_gather(at::tensor(begun, at::kLong)).max(0));
  const int64_t* last_p = last.data_ptr<int64_t>();
  int64_t waited = 0;
  for (int64_t i = 0; i < n; ++i) {
    waited += std::clamp<int64_t>(last_p[i] - times[i].begun, 0, times[i].ended - times[i].begun);
  }
  return static_cast<double>(waited) * 1e-9;
}

}  // namespace ulysses
