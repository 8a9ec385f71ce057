// Process groups for sequence parallelism, over PyTorch's c10d (Gloo on CPU; NCCL on CUDA
// builds).
//
// World = DP x SP mesh; SP groups are consecutive ranks:
//   sp_group(w) = { (w / P) * P + i : 0 <= i < P },   dp_group(w) = { w % P + j * P : j }.
// Every collective runs under GroupOptions::timeout: a dead or absent peer is an error, not a
// hang. `agree` is the fail-fast step: ranks exchange the outcome of their local checks before
// any data moves, so an invalid setup raises the same error on every rank.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace ulysses {

// Which c10d backend carries the collectives.
enum class Backend {
  kGloo,  // CPU tensors; always available.
  kNccl,  // CUDA tensors; only when libtorch was built with NCCL.
};

// Options of a process group.
struct GroupOptions {
  // Limit for every collective and for rendezvous. A peer silent this long is an error.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  // Address the Gloo transport binds to. Empty: loopback for a loopback or unset MASTER_ADDR,
  // else the address this host's name resolves to.
  std::string gloo_address = "";
  Backend backend = Backend::kGloo;
  // Most bytes of freed buffers (see Group::new_buffer) this group keeps for reuse.
  int64_t buffer_cache_bytes = int64_t{1} << 30;
};

namespace detail {
struct GroupState;
}

// A handle to one process group: cheap to copy (copies share the connection and counters).
class Group {
 public:
  // Rank `rank` of `size` ranks that meet through `store` (every rank passes the same store
  // contents; a HashStore shared by threads, or a TCPStore).
  static Group create(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                      const GroupOptions& options = {});
  // The world group described by torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR
  // (default 127.0.0.1), MASTER_PORT (default 29500). Without WORLD_SIZE: one rank alone.
  static Group from_env(const GroupOptions& options = {});

  int rank() const;
  int size() const;
  const GroupOptions& options() const;
  // The store this group met through (sub-groups meet through prefixes of it).
  c10::intrusive_ptr<c10d::Store> store() const;

  // Splits the flat buffer `input` into chunks of `input_splits` elements, sends chunk j to
  // rank j, and receives rank j's chunk for us into `output` at the offsets of
  // `output_splits`. Both tensors are 1-D and contiguous.
  void all_to_all(at::Tensor& output, at::Tensor& input, const std::vector<int64_t>& output_splits,
                  const std::vector<int64_t>& input_splits) const;
  // An uninitialised tensor whose memory comes from this group's cache of freed buffers and
  // goes back to it when the tensor dies. Ops use it for staging buffers and outputs: on this
  // kind of machine faulting in a fresh 33 MB buffer costs ~10x copying into a reused one.
  at::Tensor new_buffer(at::IntArrayRef shape, const at::TensorOptions& options) const;

  // Every rank's `input` (same shape on every rank), stacked: [P, *input.shape].
  at::Tensor all_gather(const at::Tensor& input) const;
  // In-place sum (or other c10d reduction) of `tensor` over the group.
  void all_reduce_sum(at::Tensor& tensor) const;
  // Copies rank `root`'s `tensor` into every rank's `tensor`.
  void broadcast(at::Tensor& tensor, int root) const;
  void barrier() const;

  // Fail-fast agreement. Runs `local_check` on this rank; it returns this rank's metadata (a
  // vector of `meta_size` integers) or throws. Then the ranks exchange outcomes in one small
  // collective: if any rank threw, every rank throws the same error (the lowest failing
  // rank's, of the same c10 error type, naming that rank); otherwise returns every rank's
  // metadata, in rank order.
  std::vector<std::vector<int64_t>> agree(const std::function<std::vector<int64_t>()>& local_check,
                                          size_t meta_size = 0) const;

  // True when both handles share one connection (e.g. a mesh whose SP group is the world).
  bool operator==(const Group& other) const { return state_ == other.state_; }
  bool operator!=(const Group& other) const { return state_ != other.state_; }

  // Collectives issued through this group (agree counts once per round): for tests and
  // benchmarks.
  int64_t collective_count() const;
  // Wall-clock seconds spent inside collectives issued through this group (copies share it).
  double collective_seconds() const;

 private:
  explicit Group(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::GroupState> state_;  // Never null.
};

// World = DP x SP. SP groups are consecutive blocks of `sp_size` ranks; DP groups take one
// rank of each SP group.
struct Mesh {
  // Builds both sub-groups of this rank. world.size() must be a multiple of sp_size.
  static Mesh create(const Group& world, int sp_size);
  Group world;
  Group sp;
  Group dp;
};

}  // namespace ulysses
