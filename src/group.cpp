#include "ulysses/group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <atomic>
#include <map>
#include <mutex>
#include <chrono>
#include <cstdlib>
#include <sstream>

#include "detail/compat.h"

namespace ulysses {
namespace detail {

// Freed buffers by exact byte size, reused by later buffers of the same size (training steps
// repeat their shapes). Bounded by GroupOptions::buffer_cache_bytes; thread-safe.
class BufferCache {
 public:
  explicit BufferCache(int64_t limit) : limit_(limit) {}
  ~BufferCache() {
    for (auto& kv : free_)
      for (void* p : kv.second) std::free(p);
  }
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
        return p;
      }
    }
    void* p = nullptr;
    if (posix_memalign(&p, 64, std::max<size_t>(bytes, 64)) != 0) throw std::bad_alloc();
    return p;
  }
  void give_back(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_ + static_cast<int64_t>(bytes) > limit_) {
      std::free(p);
      return;
    }
    free_[bytes].push_back(p);
    cached_ += bytes;
  }

 private:
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // Guarded by mu_.
  int64_t cached_ = 0;                         // Bytes in free_; <= limit_.
  const int64_t limit_;
};

struct GroupState {
  c10::intrusive_ptr<C10dBackend> backend;  // Never null.
  c10::intrusive_ptr<c10d::Store> store;    // The store the group met through.
  GroupOptions options;
  int rank = 0;
  int size = 1;
  std::atomic<int64_t> collectives{0};     // Collectives issued.
  std::atomic<int64_t> collective_ns{0};   // Wall time spent inside them.
  std::shared_ptr<BufferCache> buffers;    // Shared with the deleters of tensors it lent.
};

// Counts one collective and the time spent in it.
class CollectiveScope {
 public:
  explicit CollectiveScope(GroupState& s) : s_(s), t0_(std::chrono::steady_clock::now()) {
    ++s_.collectives;
  }
  ~CollectiveScope() {
    s_.collective_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - t0_)
                            .count();
  }

 private:
  GroupState& s_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace detail

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

int env_int(const char* name, int fallback) {
  const std::string v = env_or(name, "");
  if (v.empty()) return fallback;
  try {
    return std::stoi(v);
  } catch (const std::exception&) {
    TORCH_CHECK_VALUE(false, "Group::from_env: ", name, " must be an integer; got '", v, "'");
  }
}

bool is_loopback(const std::string& addr) {
  return addr.empty() || addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

// Waits for `work`, turning a backend failure into an error that says where it happened.
void wait(const detail::GroupState& s, const char* op,
          const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait(s.options.timeout);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ulysses: collective ", op, " failed on rank ", s.rank, " of ", s.size,
                " (timeout ", s.options.timeout.count(), " ms; a peer may have died or skipped it): ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ulysses: collective ", op, " failed on rank ", s.rank, " of ", s.size,
                " (timeout ", s.options.timeout.count(), " ms; a peer may have died or skipped it): ",
                e.what());
  }
}

}  // namespace

Group Group::create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                    const GroupOptions& options) {
  TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size,
                    "Group::create: rank must be in [0, size); got rank=", rank, ", size=", size);
  auto state = std::make_shared<detail::GroupState>();
  state->store = store;
  state->options = options;
  state->rank = rank;
  state->size = size;
  state->buffers = std::make_shared<detail::BufferCache>(options.buffer_cache_bytes);
  store->setTimeout(options.timeout);
  switch (options.backend) {
    case Backend::kGloo: {
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
      const std::string addr = options.gloo_address.empty() ? "127.0.0.1" : options.gloo_address;
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(addr));
      state->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
      break;
    }
    case Backend::kNccl: {
#ifdef USE_C10D_NCCL
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = options.timeout;
      state->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, nccl_options);
      break;
#else
      TORCH_CHECK_NOT_IMPLEMENTED(false,
                                  "Group::create: this libtorch was built without NCCL; use "
                                  "Backend::kGloo");
#endif
    }
  }
  return Group(std::move(state));
}

Group Group::from_env(const GroupOptions& options) {
  const int world = env_int("WORLD_SIZE", 1);
  const int rank = env_int("RANK", 0);
  if (world == 1) return create(c10::make_intrusive<c10d::HashStore>(), 0, 1, options);
  const std::string addr = env_or("MASTER_ADDR", "127.0.0.1");
  const int port = env_int("MASTER_PORT", 29500);
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(port);
  store_options.isServer = rank == 0;
  store_options.numWorkers = world;
  store_options.timeout = options.timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>(addr, store_options);
  GroupOptions resolved = options;
  if (resolved.gloo_address.empty() && !is_loopback(addr)) {
    resolved.gloo_address = env_or("ULYSSES_GLOO_ADDRESS", "");
    TORCH_CHECK_VALUE(!resolved.gloo_address.empty(),
                      "Group::from_env: MASTER_ADDR=", addr,
                      " is not loopback; set GroupOptions::gloo_address or ULYSSES_GLOO_ADDRESS "
                      "to this host's address");
  }
  return create(store, rank, world, resolved);
}

int Group::rank() const { return state_->rank; }
int Group::size() const { return state_->size; }
const GroupOptions& Group::options() const { return state_->options; }
c10::intrusive_ptr<c10d::Store> Group::store() const { return state_->store; }
int64_t Group::collective_count() const { return state_->collectives.load(); }
double Group::collective_seconds() const { return state_->collective_ns.load() * 1e-9; }

at::Tensor Group::new_buffer(at::IntArrayRef shape, const at::TensorOptions& options) const {
  TORCH_INTERNAL_ASSERT(options.device().is_cpu());
  const size_t bytes = c10::multiply_integers(shape) * options.dtype().itemsize();
  std::shared_ptr<detail::BufferCache> cache = state_->buffers;
  void* p = cache->take(bytes);
  return at::from_blob(
      p, shape, [cache, bytes](void* q) { cache->give_back(q, bytes); }, options);
}

void Group::all_to_all(at::Tensor& output, at::Tensor& input,
                       const std::vector<int64_t>& output_splits,
                       const std::vector<int64_t>& input_splits) const {
  TORCH_INTERNAL_ASSERT(output.dim() == 1 && input.dim() == 1 && output.is_contiguous() &&
                        input.is_contiguous());
  detail::CollectiveScope scope(*state_);
  if (size() == 1) {
    output.copy_(input);
    return;
  }
  std::vector<int64_t> out_splits = output_splits, in_splits = input_splits;
  wait(*state_, "all_to_all",
       state_->backend->alltoall_base(output, input, out_splits, in_splits));
}

at::Tensor Group::all_gather(const at::Tensor& input) const {
  detail::CollectiveScope scope(*state_);
  at::Tensor in = input.contiguous();
  if (size() == 1) return in.unsqueeze(0).clone();
  at::Tensor out = at::empty({size(), in.numel()}, in.options());
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int i = 0; i < size(); ++i) outputs[0].push_back(out[i]);
  std::vector<at::Tensor> inputs{in.view({-1})};
  wait(*state_, "all_gather", state_->backend->allgather(outputs, inputs));
  std::vector<int64_t> shape{size()};
  for (int64_t s : in.sizes()) shape.push_back(s);
  return out.view(shape);
}

void Group::all_reduce_sum(at::Tensor& tensor) const {
  detail::CollectiveScope scope(*state_);
  if (size() == 1) return;
  std::vector<at::Tensor> tensors{tensor};
  wait(*state_, "all_reduce", state_->backend->allreduce(tensors));
}

void Group::broadcast(at::Tensor& tensor, int root) const {
  detail::CollectiveScope scope(*state_);
  if (size() == 1) return;
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  wait(*state_, "broadcast", state_->backend->broadcast(tensors, opts));
}

void Group::barrier() const {
  detail::CollectiveScope scope(*state_);
  if (size() == 1) return;
  wait(*state_, "barrier", state_->backend->barrier());
}

namespace {
// Error kinds carried through `agree`, so every rank rethrows the original type.
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
    case kValue: TORCH_CHECK_VALUE(false, msg);
    case kType: TORCH_CHECK_TYPE(false, msg);
    case kNotImplemented: TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
    case kIndex: TORCH_CHECK_INDEX(false, msg);
    default: TORCH_CHECK(false, msg);
  }
}
}  // namespace

std::vector<std::vector<int64_t>> Group::agree(
    const std::function<std::vector<int64_t>()>& local_check, size_t meta_size) const {
  int64_t kind = kNoError;
  std::string message;
  std::vector<int64_t> meta;
  try {
    meta = local_check();
    TORCH_INTERNAL_ASSERT(meta.size() == meta_size, "agree: metadata of size ", meta.size(),
                          ", expected ", meta_size);
  } catch (const c10::Error& e) {
    kind = classify(e);
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    kind = kOther;
    message = e.what();
  }
  if (kind != kNoError) meta.assign(meta_size, 0);

  // Round 1: [kind, message length, meta...] from every rank.
  const int64_t row = 2 + static_cast<int64_t>(meta_size);
  at::Tensor mine = at::empty({row}, at::kLong);
  auto* p = mine.data_ptr<int64_t>();
  p[0] = kind;
  p[1] = static_cast<int64_t>(message.size());
  std::copy(meta.begin(), meta.end(), p + 2);
  at::Tensor all = all_gather(mine);
  auto acc = all.accessor<int64_t, 2>();
  int failing = -1;
  int64_t longest = 0;
  for (int r = 0; r < size(); ++r) {
    if (acc[r][0] != kNoError && failing < 0) failing = r;
    longest = std::max(longest, acc[r][1]);
  }
  if (failing < 0) {
    std::vector<std::vector<int64_t>> out(size());
    for (int r = 0; r < size(); ++r) out[r].assign(&acc[r][2], &acc[r][2] + meta_size);
    return out;
  }
  // Round 2 (failures only): every rank learns the failing rank's message.
  at::Tensor text = at::zeros({longest}, at::kByte);
  std::copy(message.begin(), message.end(), text.data_ptr<uint8_t>());
  at::Tensor texts = all_gather(text);
  const auto* chars = reinterpret_cast<const char*>(texts[failing].data_ptr<uint8_t>());
  std::string failed(chars, chars + acc[failing][1]);
  std::ostringstream msg;
  msg << failed << " [raised on rank " << failing << " of " << size() << "]";
  throw_kind(acc[failing][0], msg.str());
}

Mesh Mesh::create(const Group& world, int sp_size) {
  TORCH_CHECK_VALUE(sp_size >= 1 && world.size() % sp_size == 0,
                    "Mesh::create: world size (", world.size(),
                    ") must be a multiple of the sequence-parallel size (", sp_size, ")");
  const int w = world.rank();
  const int dp_size = world.size() / sp_size;
  if (sp_size == world.size()) {
    auto solo = c10::make_intrusive<c10d::PrefixStore>("dp" + std::to_string(w), world.store());
    return Mesh{world, world, Group::create(solo, 0, 1, world.options())};
  }
  auto sp_store =
      c10::make_intrusive<c10d::PrefixStore>("sp" + std::to_string(w / sp_size), world.store());
  Group sp = Group::create(sp_store, w % sp_size, sp_size, world.options());
  auto dp_store =
      c10::make_intrusive<c10d::PrefixStore>("dp" + std::to_string(w % sp_size), world.store());
  Group dp = Group::create(dp_store, w / sp_size, dp_size, world.options());
  return Mesh{world, sp, dp};
}

}  // namespace ulysses
