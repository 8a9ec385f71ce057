#include "ulysses/group.h"

#include <ATen/ThreadLocalPythonObjects.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "transport/agreement.h"
#include "transport/op_options.h"
#include "transport/shared_memory.h"

namespace ulysses {

// Most metadata values one rank contributes to Group::agree.
constexpr int64_t kAgreeMetaLimit = 96;

namespace detail {

// Freed buffers, reused by later requests of the same byte size (training steps repeat their
// shapes). Holds at most GroupOptions::buffer_cache_bytes, evicting the least recently freed
// buffers first, so sizes a step no longer uses (another sequence length) make room for the
// ones it does. Thread-safe.
class BufferCache {
 public:
  explicit BufferCache(int64_t limit) : limit_(limit) {}
  ~BufferCache() {
    for (const Entry& e : free_) std::free(e.p);
  }
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {  // Newest first.
        if (it->bytes != bytes) continue;
        void* p = it->p;
        free_.erase(it);
        cached_ -= static_cast<int64_t>(bytes);
        return p;
      }
    }
    void* p = nullptr;
    if (posix_memalign(&p, 64, std::max<size_t>(bytes, 64)) != 0) throw std::bad_alloc();
    return p;
  }
  void give_back(void* p, size_t bytes) {
    if (static_cast<int64_t>(bytes) > limit_) {
      std::free(p);
      return;
    }
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_front({bytes, p});
      cached_ += static_cast<int64_t>(bytes);
      while (cached_ > limit_) {
        evicted.push_back(free_.back().p);
        cached_ -= static_cast<int64_t>(free_.back().bytes);
        free_.pop_back();
      }
    }
    for (void* q : evicted) std::free(q);  // Outside the lock: returning pages takes time.
  }
  int64_t cached() {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_;
  }

 private:
  struct Entry {
    size_t bytes;
    void* p;
  };
  std::mutex mu_;
  std::list<Entry> free_;  // Most recently freed first; guarded by mu_.
  int64_t cached_ = 0;     // Bytes in free_; <= limit_ outside give_back.
  const int64_t limit_;
};

// State shared by every handle of one process group.
struct GroupRuntime {
  explicit GroupRuntime(int64_t cache_bytes)
      : buffers(std::make_shared<BufferCache>(cache_bytes)) {}
  std::atomic<int64_t> collectives{0};    // Collectives issued.
  std::atomic<int64_t> collective_ns{0};  // Wall time inside them and in point-to-point waits.
  std::atomic<int64_t> p2p_messages{0};   // Point-to-point sends posted.
  std::atomic<int64_t> p2p_bytes{0};      // Their bytes.
  std::shared_ptr<BufferCache> buffers;   // Shared with the deleters of tensors it lent.
  std::mutex links_mu;
  std::unique_ptr<SharedMemoryLinks> links;  // Set up on first use; guarded by links_mu.
  ArmedAgreement armed;                      // Note [Reused agreement].
  // Note [Waiting for the last rank]: when each kept collective began and ended.
  std::atomic<bool> keep_times{false};
  std::mutex times_mu;
  std::vector<std::array<int64_t, 3>> times;  // {number, begun, ended} (steady_clock ns).
};

// Counts one collective and the time spent in it.
// Clears this thread's stashed Python objects while a collective is issued. A c10d Work copies
// the issuing thread's state, and every backward stashes a Python object there (autograd's
// contextvars context). The backend's worker thread often drops the last reference to a Work,
// and the decref then needs the GIL; at interpreter exit that thread is ended inside a noexcept
// destructor, and the process aborts ("terminate called without an active exception"). Without
// Python objects a Work never touches the GIL.
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

class CollectiveScope {
 public:
  explicit CollectiveScope(GroupRuntime& s)
      : s_(s), number_(++s_.collectives), t0_(std::chrono::steady_clock::now()) {}
  // This collective's number on its process group (1 for the first), as logged by slow waits.
  int64_t number() const { return number_; }
  ~CollectiveScope() {
    const auto t1 = std::chrono::steady_clock::now();
    s_.collective_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0_).count();
    if (s_.keep_times.load()) {
      std::lock_guard<std::mutex> lock(s_.times_mu);
      s_.times.push_back({number_, t0_.time_since_epoch().count(), t1.time_since_epoch().count()});
    }
  }

 private:
  GroupRuntime& s_;
  const int64_t number_;
  std::chrono::steady_clock::time_point t0_;
  NoPythonObjectsInWork no_python_;
};

}  // namespace detail

namespace {

// Runtime state per live process group, so that handles resolved by name on every op call
// share one buffer cache and one set of counters. Entries of destroyed groups are dropped.
struct RuntimeEntry {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  std::shared_ptr<detail::GroupRuntime> runtime;
};

std::shared_ptr<detail::GroupRuntime> runtime_of(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                 int64_t cache_bytes) {
  static std::mutex mu;
  static std::map<const c10d::ProcessGroup*, RuntimeEntry> entries;  // Guarded by mu.
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = entries.begin(); it != entries.end();) {
    it = it->second.group.expired() ? entries.erase(it) : std::next(it);
  }
  auto it = entries.find(pg.get());
  if (it != entries.end()) return it->second.runtime;
  auto runtime = std::make_shared<detail::GroupRuntime>(cache_bytes);
  entries.emplace(pg.get(), RuntimeEntry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg), runtime});
  return runtime;
}

// Whether `pg` has a backend for `device` tensors. Through getDeviceTypes, which every
// supported torch has (2.11's ProcessGroup lacks hasBackendForDeviceType).
bool has_backend(const c10d::ProcessGroup& pg, c10::DeviceType device) {
  for (const c10::Device& d : pg.getDeviceTypes())
    if (d.type() == device) return true;
  return false;
}

// Whether `pg`'s backend for `device` posts point-to-point transfers as coalesced groups.
bool coalesces(c10d::ProcessGroup& pg, c10::DeviceType device) {
  return has_backend(pg, device) && pg.getBackend(device)->supportsCoalescing();
}

void check_options(const GroupOptions& options) {
  TORCH_CHECK_VALUE(options.timeout.count() > 0, "Group: timeout must be > 0 ms; got ",
                    options.timeout.count(), " ms");
  TORCH_CHECK_VALUE(options.buffer_cache_bytes >= 0, "Group: buffer_cache_bytes must be >= 0; got ",
                    options.buffer_cache_bytes);
  TORCH_CHECK_VALUE(options.buffer_cache_min_bytes >= 0,
                    "Group: buffer_cache_min_bytes must be >= 0; got ",
                    options.buffer_cache_min_bytes);
  TORCH_CHECK_VALUE(options.log_wait_fraction >= 0 && options.log_wait_fraction <= 1,
                    "Group: log_wait_fraction must be in [0, 1]; got ", options.log_wait_fraction);
  TORCH_CHECK_VALUE(options.pipeline_min_bytes >= 0 && options.message_bytes > 0,
                    "Group: pipeline_min_bytes must be >= 0 and message_bytes > 0; got ",
                    options.pipeline_min_bytes, " and ", options.message_bytes);
}

// Peers whose contribution a collective of this rank waits for: every other rank, or for an
// all-to-all only those it exchanges a non-empty chunk with.
std::string peer_list(const Group& g, const std::vector<int64_t>* out_splits,
                      const std::vector<int64_t>* in_splits) {
  std::ostringstream peers;
  const char* sep = "";
  for (int r = 0; r < g.size(); ++r) {
    if (r == g.rank()) continue;
    if (out_splits && (*out_splits)[r] == 0 && (*in_splits)[r] == 0) continue;
    peers << sep << r;
    sep = ", ";
  }
  return peers.str();
}

std::string seconds(std::chrono::milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", t.count() / 1e3);
  return text;
}

// Waits for `work`, turning a backend failure into an error that says where it happened. A
// wait longer than GroupOptions::log_wait_fraction of the timeout is logged once, naming the
// collective, its number on this group and the peers it needs: with a frozen or lagging rank
// every other rank says what it is stuck in long before the timeout ends the job.
// Device tensors (Note [Waits] in group.h): the wait orders the current stream after the
// collective and returns; the process group enforces its own timeout.
void wait(const Group& g, const char* op, const c10::intrusive_ptr<c10d::Work>& work,
          int64_t number, c10::DeviceType device, const std::vector<int64_t>* out_splits = nullptr,
          const std::vector<int64_t>* in_splits = nullptr) {
  using std::chrono::milliseconds;
  const milliseconds timeout = g.options().timeout;
  auto fail = [&](const std::string& what) {
    TORCH_CHECK(false, "ulysses: collective ", op, " #", number, " failed on rank ", g.rank(),
                " of ", g.size(), " (timeout ", timeout.count(),
                " ms; a peer may have died or skipped it): ", what);
  };
  const double fraction = g.options().log_wait_fraction;
  milliseconds first = timeout;
  if (fraction > 0 && fraction < 1) {
    first =
        std::max(milliseconds(1), milliseconds(static_cast<int64_t>(timeout.count() * fraction)));
  }
  try {
    if (!Group::waits_on_host(device)) {
      work->wait();
      return;
    }
    try {
      work->wait(first);
      return;
    } catch (const std::exception&) {
      // Work::wait throws when its wait ends before the work completes: then only slow.
      if (work->isCompleted() || first == timeout) throw;
    }
    // c10 logging, not TORCH_WARN: under Python a TORCH_WARN is held until the op returns, and
    // this line matters while the op is stuck. TORCH_CPP_LOG_LEVEL=ERROR silences it.
    LOG(WARNING) << "ulysses: rank " << g.rank() << " of " << g.size() << " has waited "
                 << seconds(first) << " s of its " << seconds(timeout) << " s timeout in " << op
                 << " #" << number << " of group '" << g.name() << "' for ranks "
                 << peer_list(g, out_splits, in_splits);
    work->wait(timeout - first);
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

}  // namespace

Group::Group(c10::intrusive_ptr<c10d::ProcessGroup> pg,
             std::shared_ptr<detail::GroupRuntime> runtime, int rank, int size,
             GroupOptions options)
    : pg_(std::move(pg)),
      runtime_(std::move(runtime)),
      rank_(rank),
      size_(size),
      options_(options) {}

Group Group::from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                const GroupOptions& options) {
  TORCH_CHECK_VALUE(process_group, "Group::from_process_group: process_group must not be null");
  check_options(options);
  auto runtime = runtime_of(process_group, options.buffer_cache_bytes);
  const int rank = process_group->getRank(), size = process_group->getSize();
  return Group(std::move(process_group), std::move(runtime), rank, size, options);
}

Group Group::resolve(const std::string& name, const GroupOptions& options) {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(name);
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, "Group::resolve: no live process group is registered under the name '",
                      name, "' (pass a group made by torch.distributed, or its group_name)");
  }
  return from_process_group(std::move(pg), options);
}

Group Group::solo(const GroupOptions& options) {
  check_options(options);
  return Group({}, std::make_shared<detail::GroupRuntime>(options.buffer_cache_bytes), 0, 1,
               options);
}

std::vector<int64_t> options_to_ints(const GroupOptions& options) {
  return {options.timeout.count(), options.pipeline_min_bytes, options.message_bytes,
          options.shared_memory ? 1 : 0, static_cast<int64_t>(options.transport)};
}

GroupOptions options_from_ints(c10::IntArrayRef values) {
  GroupOptions o;
  TORCH_CHECK_VALUE(values.size() <= 5, "Group: group_options has at most 5 values ([timeout ms, ",
                    "pipeline_min_bytes, message_bytes, shared_memory, transport]); got ",
                    values.size());
  if (values.size() > 0) o.timeout = std::chrono::milliseconds(values[0]);
  if (values.size() > 1) o.pipeline_min_bytes = values[1];
  if (values.size() > 2) o.message_bytes = values[2];
  if (values.size() > 3) o.shared_memory = values[3] != 0;
  if (values.size() > 4) {
    TORCH_CHECK_VALUE(values[4] >= 0 && values[4] <= 2,
                      "Group: group_options' transport must be 0 (auto), 1 (messages) or 2 "
                      "(batched); got ",
                      values[4]);
    o.transport = static_cast<GroupOptions::Transport>(values[4]);
  }
  return o;
}

Group Group::from_op(const std::string& name, c10::IntArrayRef options) {
  const GroupOptions o = options_from_ints(options);
  return name.empty() ? solo(o) : resolve(name, o);
}

std::string Group::op_name() const {
  if (!pg_) return "";
  std::string name = pg_->getGroupName();
  try {
    if (!name.empty() && c10d::resolve_process_group(name).get() == pg_.get()) return name;
  } catch (const std::exception&) {
  }
  // Handed over by a C++ caller without a registered name: register it under one of ours.
  std::ostringstream os;
  os << "ulysses:" << static_cast<const void*>(pg_.get());
  name = os.str();
  try {
    if (c10d::resolve_process_group(name).get() == pg_.get()) return name;
  } catch (const std::exception&) {
  }
  c10d::register_process_group(name, pg_);
  return name;
}

Group Group::with_options(const GroupOptions& options) const {
  check_options(options);
  return Group(pg_, runtime_, rank_, size_, options);
}

std::string Group::name() const { return pg_ ? pg_->getGroupName() : std::string(); }
int64_t Group::collective_count() const { return runtime_->collectives.load(); }
int64_t Group::cached_buffer_bytes() const { return runtime_->buffers->cached(); }
double Group::collective_seconds() const { return runtime_->collective_ns.load() * 1e-9; }

// Note [Waiting for the last rank]
// A collective cannot finish before its last rank arrives, so a rank's wall time inside it is
// the wait for that rank plus the transfer itself. The wait says nothing about the transport: it
// is a straggler, or, with more ranks than cores, a rank that has no core yet. Splitting the two
// takes every rank's arrival times on one clock: steady_clock is the boot's monotonic clock, so
// ranks that share a boot compare them directly, and ranks on other hosts get no split.
void Group::keep_collective_times() const {
  std::lock_guard<std::mutex> lock(runtime_->times_mu);
  runtime_->times.clear();
  runtime_->keep_times = true;
}

std::optional<double> Group::take_waiting_seconds() const {
  std::vector<std::array<int64_t, 3>> times;
  {
    std::lock_guard<std::mutex> lock(runtime_->times_mu);
    times.swap(runtime_->times);
  }
  std::sort(times.begin(), times.end());  // By number: threads may end them out of order.
  const auto n = static_cast<int64_t>(times.size());
  const int64_t host = detail::boot_key();
  const at::Tensor keys = all_gather(at::tensor({host, n, times.empty() ? 0 : times[0][0]}));
  for (int r = 0; r < size(); ++r) {  // Another boot, or other collectives: no common clock.
    if (keys[r][0].item<int64_t>() != host || host == 0 || keys[r][1].item<int64_t>() != n ||
        keys[r][2].item<int64_t>() != keys[0][2].item<int64_t>()) {
      return std::nullopt;
    }
  }
  if (n == 0) return 0.0;
  std::vector<int64_t> begun;
  for (const auto& t : times) begun.push_back(t[1]);
  const at::Tensor last = std::get<0>(all_gather(at::tensor(begun, at::kLong)).max(0));
  const int64_t* last_p = last.data_ptr<int64_t>();
  int64_t waited = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t begun_at = times[i][1], ended_at = times[i][2];
    waited += std::clamp<int64_t>(last_p[i] - begun_at, 0, ended_at - begun_at);
  }
  return static_cast<double>(waited) * 1e-9;
}

int64_t Group::p2p_messages_sent() const { return runtime_->p2p_messages.load(); }
int64_t Group::p2p_bytes_sent() const { return runtime_->p2p_bytes.load(); }

bool Group::batches(c10::DeviceType device) const {
  // Off the CPU, unbatched point-to-point is never safe (NCCL runs it in posting order: a
  // receive posted before its peer's send waits forever), whatever the options say.
  if (device != c10::DeviceType::CPU) return true;
  switch (options_.transport) {
    case GroupOptions::Transport::kMessages:
      return false;
    case GroupOptions::Transport::kBatched:
      return true;
    default:  // Where the backend coalesces, it needs it (NCCL).
      return pg_ && coalesces(*pg_, device);
  }
}

Transfers::Transfers(const Group& group, c10::DeviceType device)
    : group_(group), device_(device), batched_(group.batches(device)) {
  TORCH_CHECK_VALUE(group.process_group(), "Transfers: point-to-point needs a multi-rank group");
  coalesced_ = batched_ && coalesces(*group.pg_, device);
  number_ = group.runtime_->p2p_messages.load() + 1;
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
  group_.runtime_->p2p_messages += 1;
  group_.runtime_->p2p_bytes += static_cast<int64_t>(t.nbytes());
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
  std::vector<at::Tensor> tensors{t.tensor};
  const auto& pg = group_.pg_;
  t.work = t.send ? pg->send(tensors, t.peer, t.tag) : pg->recv(tensors, t.peer, t.tag);
}

void Transfers::post() {
  if (posted_ == transfers_.size()) return;
  detail::NoPythonObjectsInWork no_python;
  const auto& pg = group_.pg_;
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
  group_.runtime_->collective_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
}

void Transfers::wait() {
  for (size_t i = 0; i < transfers_.size(); ++i) wait(i);
  transfers_.clear();
  posted_ = 0;
}

bool GroupOptions::shared_memory_from_environment() {
  const char* v = std::getenv("ULYSSES_SHARED_MEMORY");
  return v == nullptr || std::string(v) != "0";
}

GroupOptions::Transport GroupOptions::transport_from_environment() {
  const char* v = std::getenv("ULYSSES_TRANSPORT");
  if (v == nullptr || *v == 0) return Transport::kAuto;
  try {
    return parse_transport(v);
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, "ULYSSES_TRANSPORT: ", e.what_without_backtrace());
  }
}

namespace {
constexpr const char* kTransportNames[] = {"auto", "messages", "batched"};
}

std::string to_string(GroupOptions::Transport transport) {
  return kTransportNames[static_cast<int>(transport)];
}

GroupOptions::Transport parse_transport(const std::string& text) {
  for (int i = 0; i < 3; ++i)
    if (text == kTransportNames[i]) return static_cast<GroupOptions::Transport>(i);
  TORCH_CHECK_VALUE(false, "the transport must be auto, messages or batched; got '", text, "'");
}

detail::ArmedAgreement& detail::armed_agreement(const Group& group) {
  return group.runtime_->armed;
}

detail::SharedMemoryLinks& detail::shared_memory_links(const Group& group) {
  std::lock_guard<std::mutex> lock(group.runtime_->links_mu);
  if (!group.runtime_->links)
    group.runtime_->links = std::make_unique<detail::SharedMemoryLinks>(group);
  return *group.runtime_->links;
}

at::Tensor Group::new_buffer(at::IntArrayRef shape, const at::TensorOptions& options) const {
  const size_t bytes = c10::multiply_integers(shape) * options.dtype().itemsize();
  if (!options.device().is_cpu() || static_cast<int64_t>(bytes) < options_.buffer_cache_min_bytes)
    return at::empty(shape, options);
  std::shared_ptr<detail::BufferCache> cache = runtime_->buffers;
  void* p = cache->take(bytes);
  return at::from_blob(p, shape, [cache, bytes](void* q) { cache->give_back(q, bytes); }, options);
}

void Group::all_to_all(at::Tensor& output, at::Tensor& input,
                       const std::vector<int64_t>& output_splits,
                       const std::vector<int64_t>& input_splits) const {
  TORCH_INTERNAL_ASSERT(output.dim() == 1 && input.dim() == 1 && output.is_contiguous() &&
                        input.is_contiguous());
  detail::CollectiveScope scope(*runtime_);
  if (size() == 1) {
    output.copy_(input);
    return;
  }
  std::vector<int64_t> out_splits = output_splits, in_splits = input_splits;
  wait(*this, "all_to_all", pg_->alltoall_base(output, input, out_splits, in_splits),
       scope.number(), output.device().type(), &output_splits, &input_splits);
}

at::Tensor Group::all_gather(const at::Tensor& input) const {
  detail::CollectiveScope scope(*runtime_);
  at::Tensor in = input.contiguous();
  if (size() == 1) return in.unsqueeze(0).clone();
  at::Tensor out = at::empty({size(), in.numel()}, in.options());
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int i = 0; i < size(); ++i) outputs[0].push_back(out[i]);
  std::vector<at::Tensor> inputs{in.view({-1})};
  wait(*this, "all_gather", pg_->allgather(outputs, inputs), scope.number(), in.device().type());
  std::vector<int64_t> shape{size()};
  for (int64_t s : in.sizes()) shape.push_back(s);
  return out.view(shape);
}

void Group::all_reduce_sum(at::Tensor& tensor) const {
  detail::CollectiveScope scope(*runtime_);
  if (size() == 1) return;
  std::vector<at::Tensor> tensors{tensor};
  wait(*this, "all_reduce", pg_->allreduce(tensors), scope.number(), tensor.device().type());
}

void Group::broadcast(at::Tensor& tensor, int root) const {
  detail::CollectiveScope scope(*runtime_);
  if (size() == 1) return;
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  wait(*this, "broadcast", pg_->broadcast(tensors, opts), scope.number(), tensor.device().type());
}

void Group::barrier() const {
  detail::CollectiveScope scope(*runtime_);
  if (size() == 1) return;
  // A barrier holds the host on every backend: timed as CPU work.
  wait(*this, "barrier", pg_->barrier(), scope.number(), c10::DeviceType::CPU);
}

namespace {
// Error tensor_heads carried through `agree`, so every rank rethrows the original type.
enum ErrorKind : int64_t { kNoError = 0, kValue, kType, kNotImplemented, kIndex, kOther };

ErrorKind classify(const c10::Error& e) {
  if (dynamic_cast<const c10::ValueError*>(&e)) return kValue;
  if (dynamic_cast<const c10::TypeError*>(&e)) return kType;
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return kNotImplemented;
  if (dynamic_cast<const c10::IndexError*>(&e)) return kIndex;
  return kOther;
}

[[noreturn]] void throw_kind(int64_t kind, const std::string& msg) {
  switch (kind) {
    case kValue:
      TORCH_CHECK_VALUE(false, msg);
    case kType:
      TORCH_CHECK_TYPE(false, msg);
    case kNotImplemented:
      TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
    case kIndex:
      TORCH_CHECK_INDEX(false, msg);
    default:
      TORCH_CHECK(false, msg);
  }
}
}  // namespace

namespace {
// Note [Metadata device]: the agreement rounds move a few int64s. They go as CPU tensors when
// the process group has a CPU backend (Gloo, or "cpu:gloo,cuda:nccl"), else on the current
// device of the group's accelerator (an NCCL-only group takes CUDA tensors alone).
at::Device metadata_device(c10d::ProcessGroup* pg) {
  if (pg == nullptr || has_backend(*pg, at::kCPU)) {
    return at::kCPU;
  }
  const std::vector<c10::Device> types = pg->getDeviceTypes();
  TORCH_CHECK_VALUE(!types.empty(), "Group: process group '", pg->getGroupName(),
                    "' has no backend for any device");
  return c10::impl::getDeviceGuardImpl(types.front().type())->getDevice();
}
}  // namespace

namespace {
// A non-negative 63-bit FNV-1a hash of `text`: ranks compare round purposes through it.
int64_t text_hash(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 1);
}
}  // namespace

std::vector<std::vector<int64_t>> Group::agree(
    const std::function<std::vector<int64_t>()>& local_check, const std::string& purpose) const {
  int64_t kind = kNoError;
  std::string message;
  std::vector<int64_t> meta;
  try {
    meta = local_check();
    TORCH_CHECK_VALUE(meta.size() <= static_cast<size_t>(kAgreeMetaLimit), "agree: at most ",
                      kAgreeMetaLimit, " metadata values per rank; got ", meta.size(),
                      " (too many tensors in one call?)");
  } catch (const c10::Error& e) {
    kind = classify(e);
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    kind = kOther;
    message = e.what();
  }
  if (kind != kNoError) meta.clear();

  // Round 1, the same size on every rank whatever its inputs (Gloo aborts the process on
  // mismatched sizes): [kind, message length, purpose hash, purpose length, metadata count,
  // metadata padded to the limit].
  constexpr int64_t kHeader = 5;
  const int64_t row = kHeader + kAgreeMetaLimit;
  at::Tensor mine = at::zeros({row}, at::kLong);
  auto* p = mine.data_ptr<int64_t>();
  p[0] = kind;
  p[1] = static_cast<int64_t>(message.size());
  p[2] = text_hash(purpose);
  p[3] = static_cast<int64_t>(purpose.size());
  p[4] = static_cast<int64_t>(meta.size());
  std::copy(meta.begin(), meta.end(), p + kHeader);
  const at::Device device = metadata_device(pg_.get());
  at::Tensor all = all_gather(mine.to(device)).cpu();
  auto acc = all.accessor<int64_t, 2>();
  int failing = -1;
  bool same_purpose = true;
  int64_t longest = 0, longest_purpose = 0;
  for (int r = 0; r < size(); ++r) {
    if (acc[r][0] != kNoError && failing < 0) failing = r;
    same_purpose = same_purpose && acc[r][2] == acc[0][2];
    longest = std::max(longest, acc[r][1]);
    longest_purpose = std::max(longest_purpose, acc[r][3]);
  }
  // Round 2 (failures and mixed purposes only; every rank knows the longest text): texts.
  auto gather_texts = [&](const std::string& text, int64_t longest_text) {
    at::Tensor t = at::zeros({std::max<int64_t>(1, longest_text)}, at::kByte);
    std::copy(text.begin(), text.end(), t.data_ptr<uint8_t>());
    return all_gather(t.to(device)).cpu();
  };
  auto text_of = [](const at::Tensor& texts, int r, int64_t length) {
    const auto* chars = reinterpret_cast<const char*>(texts[r].data_ptr<uint8_t>());
    return std::string(chars, chars + length);
  };
  if (failing >= 0) {
    // A failure wins over mixed purposes: fail_together's round meets any other round.
    const at::Tensor texts = gather_texts(message, longest);
    std::ostringstream msg;
    msg << text_of(texts, failing, acc[failing][1]) << " [raised on rank " << failing << " of "
        << size() << "]";
    throw_kind(acc[failing][0], msg.str());
  }
  if (!same_purpose) {
    const at::Tensor texts = gather_texts(purpose, longest_purpose);
    std::ostringstream msg;
    msg << "ranks are in different agreement rounds:";
    for (int r = 0; r < size(); ++r) {
      msg << (r ? "," : "") << " rank " << r << " in " << text_of(texts, r, acc[r][3]);
    }
    msg << ". An argument given on some ranks only (seq_lens, a mask, position_ids, a "
           "StepContext) sends ranks down different paths: give it on every rank or on none";
    TORCH_CHECK_VALUE(false, msg.str());
  }
  // Ranks of one purpose may hold different amounts (a call fingerprint is as long as its
  // tensors' dims): each caller compares what it gathered, naming the argument that differs.
  std::vector<std::vector<int64_t>> out(size());
  for (int r = 0; r < size(); ++r) out[r].assign(&acc[r][kHeader], &acc[r][kHeader] + acc[r][4]);
  return out;
}

void Group::fail_together(const std::exception_ptr& error) const {
  agree([&]() -> std::vector<int64_t> { std::rethrow_exception(error); });
  TORCH_INTERNAL_ASSERT(false, "Group::agree returned although this rank failed");
}

std::vector<std::vector<int>> Mesh::sp_partition(int world_size, int sp_size) {
  std::vector<std::vector<int>> groups(world_size / sp_size);
  for (int w = 0; w < world_size; ++w) groups[w / sp_size].push_back(w);
  return groups;
}

std::vector<std::vector<int>> Mesh::dp_partition(int world_size, int sp_size) {
  std::vector<std::vector<int>> groups(sp_size);
  for (int w = 0; w < world_size; ++w) groups[w % sp_size].push_back(w);
  return groups;
}

Mesh Mesh::create(const Group& world, int sp_size, const Split& split, int ring_size) {
  TORCH_CHECK_VALUE(sp_size >= 1 && world.size() % sp_size == 0, "Mesh::create: world size (",
                    world.size(), ") must be a multiple of the sequence-parallel size (", sp_size,
                    ")");
  TORCH_CHECK_VALUE(ring_size >= 1 && sp_size % ring_size == 0, "Mesh::create: the ring size (",
                    ring_size, ") must divide the sequence-parallel size (", sp_size, ")");
  const int n = world.size();
  auto make = [&](const std::vector<std::vector<int>>& partition) {
    if (partition.size() == 1) return world;
    if (partition[0].size() == 1) return Group::solo(world.options());
    return split(partition).with_options(world.options());
  };
  Group sp = make(sp_partition(n, sp_size));
  Group dp = make(dp_partition(n, sp_size));
  if (ring_size == 1) return Mesh{world, sp, dp, sp, Group::solo(world.options())};
  const int U = sp_size / ring_size;
  std::vector<std::vector<int>> ulysses, ring;
  for (int base = 0; base < n; base += sp_size) {
    for (int r = 0; r < ring_size; ++r) {
      ulysses.emplace_back();
      for (int u = 0; u < U; ++u) ulysses.back().push_back(base + r * U + u);
    }
    for (int u = 0; u < U; ++u) {
      ring.emplace_back();
      for (int r = 0; r < ring_size; ++r) ring.back().push_back(base + r * U + u);
    }
  }
  return Mesh{world, sp, dp, make(ulysses), make(ring)};
}

}  // namespace ulysses
