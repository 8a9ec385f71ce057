// Process groups for sequence parallelism, over PyTorch's c10d.
//
// A Group wraps a c10d::ProcessGroup made by torch.distributed (init_process_group, new_group,
// DeviceMesh) and found by its group name, or handed over by a C++ caller. Gloo carries CPU
// tensors, NCCL CUDA tensors: the ProcessGroup dispatches by the tensors' device.
//
// World = DP x SP mesh; SP groups are consecutive ranks:
//   sp_group(w) = { (w / P) * P + i : 0 <= i < P },   dp_group(w) = { w % P + j * P : j }.
// Note [Waits]: who bounds a wait depends on where the tensors live.
// - CPU tensors (Gloo): the op waits on the host, at most GroupOptions::timeout, and logs which
//   collective and peers it waits for after GroupOptions::log_wait_fraction of it: a dead or
//   absent peer is an error, not a hang.
// - Device tensors (NCCL): the op enqueues its collectives and returns; Work::wait() with no
//   timeout orders the current stream after them without holding the host. NCCL's watchdog
//   bounds them, with the timeout given to init_process_group (a timed wait there would block
//   the host until the kernel ends and, on expiry, abort the communicator). `agree` is the
//   fail-fast step: ranks exchange the outcome of their local checks before
// any data moves, so an invalid setup raises the same error on every rank.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace ulysses {

// Options of a Group handle.
struct GroupOptions {
  // Longest wait for any collective, in milliseconds; > 0. A peer silent this long is an error.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  // Most bytes of freed CPU buffers (see Group::new_buffer) kept for reuse, least recently
  // freed evicted first; >= 0. A step's transient buffers must fit, or every large exchange
  // maps fresh pages (docs/benchmarks.md, "Buffer cache").
  int64_t buffer_cache_bytes = int64_t{8} << 30;
  // CPU buffers smaller than this come from the default allocator, not the cache; >= 0. glibc's
  // heap reuses a freed block of this size for any later allocation, while a cached block is
  // held back from the rest of the step (raising the peak: docs/benchmarks.md).
  int64_t buffer_cache_min_bytes = int64_t{8} << 20;
  // A rank still waiting for a collective after this fraction of `timeout` logs (to stderr,
  // once per collective) which collective it waits in and for which peers; in [0, 1], 0 never.
  double log_wait_fraction = 0.25;
  // Ulysses all-to-alls of CPU tensors that send at least this many bytes to other ranks go as
  // point-to-point messages of about `message_bytes` each: packing message i+1 overlaps the
  // transfer of message i, blocks that land contiguously are received in place, and this rank's
  // own block is copied straight across. Smaller exchanges (and other devices, and the batched
  // transport) take one collective, where a message's fixed cost would dominate. >= 0 and > 0.
  int64_t pipeline_min_bytes = int64_t{4} << 20;
  int64_t message_bytes = int64_t{4} << 20;
  // Pipelined exchanges with ranks on this host go through shared memory (/dev/shm): the sender
  // packs its blocks into a file the receiver maps, and the receiver copies them out; other
  // ranks' blocks still go as messages. Ranks in other network namespaces count as other
  // hosts. The first such exchange of a group sets its links up with two all_gathers, counted
  // once per group (docs/benchmarks.md has its speed). Where /dev/shm cannot hold a rank's
  // outbox, its blocks go as messages instead (one warning), exact. On by default; off when
  // ULYSSES_SHARED_MEMORY is 0.
  bool shared_memory = shared_memory_from_environment();
  // How point-to-point transfers are posted (Transfers). NCCL matches sends and receives
  // between two ranks in the order they are posted, whatever their tags, and runs unbatched
  // ones one by one on a stream: a receive posted before its peer's send waits forever there.
  // Batched, the transfers of one step are posted together (one coalesced group where the
  // backend has them, as torch.distributed.batch_isend_irecv does), and whole-tensor
  // exchanges always take one collective. kAuto batches where the backend coalesces (NCCL)
  // and posts messages elsewhere (Gloo); ULYSSES_TRANSPORT=auto|messages|batched sets it.
  // kMessages applies to CPU tensors only: transfers of other devices' tensors are batched.
  enum class Transport : int64_t { kAuto = 0, kMessages = 1, kBatched = 2 };
  Transport transport = transport_from_environment();

  static bool shared_memory_from_environment();
  static Transport transport_from_environment();
};

// "auto", "messages" or "batched"; parse_transport raises c10::ValueError on any other text.
std::string to_string(GroupOptions::Transport transport);
GroupOptions::Transport parse_transport(const std::string& text);

class Group;
class Transfers;

namespace detail {
struct GroupRuntime;
class SharedMemoryLinks;
class ArmedAgreement;
SharedMemoryLinks& shared_memory_links(const Group& group);
// The group's armed agreement (Note [Reused agreement], distributed_attention.h).
ArmedAgreement& armed_agreement(const Group& group);
}  // namespace detail

// A handle to one process group: cheap to copy (copies share the connection and counters).
class Group {
 public:
  // Wraps `process_group` (never null). Runtime state (buffer cache, collective counters) is
  // shared by every handle of the same process group.
  static Group from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                  const GroupOptions& options = {});
  // The process group torch.distributed registered under `name` (its `group_name`; see
  // c10d::resolve_process_group). Throws c10::ValueError naming `name` if there is none.
  static Group resolve(const std::string& name, const GroupOptions& options = {});
  // A group of this rank alone: every collective is a local copy.
  static Group solo(const GroupOptions& options = {});
  // The group a dispatcher op names: "" is solo(); `options` as the ops carry GroupOptions
  // (src/transport/op_options.h).
  static Group from_op(const std::string& name, c10::IntArrayRef options);

  int rank() const { return rank_; }
  int size() const { return size_; }
  const GroupOptions& options() const { return options_; }
  // The same group with other options (same connection, counters and buffers).
  Group with_options(const GroupOptions& options) const;
  // The c10d group name ("" for solo()).
  std::string name() const;
  // The name dispatcher ops find this group by (from_op): its c10d name, registered with c10d
  // first if the process group was handed over without one; "" for solo().
  std::string op_name() const;
  // The wrapped process group (null for solo()).
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }

  // Splits the flat buffer `input` into chunks of `input_splits` elements, sends chunk j to
  // rank j, and receives rank j's chunk for us into `output` at the offsets of
  // `output_splits`. Both tensors are 1-D and contiguous.
  void all_to_all(at::Tensor& output, at::Tensor& input, const std::vector<int64_t>& output_splits,
                  const std::vector<int64_t>& input_splits) const;
  // An uninitialised tensor. On CPU, from buffer_cache_min_bytes up, its memory comes from this
  // group's cache of freed buffers and goes back to it when the tensor dies (faulting in fresh
  // pages costs more than the copy into them). Smaller buffers and other devices use the
  // default (caching) allocator.
  at::Tensor new_buffer(at::IntArrayRef shape, const at::TensorOptions& options) const;

  // Whether point-to-point transfers of `device` tensors go batched (GroupOptions::transport):
  // the one place the choice is made.
  bool batches(c10::DeviceType device) const;
  // Whether a wait for a collective of `device` tensors is timed and logged here (CPU tensors:
  // GroupOptions::timeout), or left to the stream and the process group (Note [Waits]).
  static bool waits_on_host(c10::DeviceType device) { return device == c10::DeviceType::CPU; }

  // Every rank's `input` (same shape on every rank), stacked: [P, *input.shape].
  at::Tensor all_gather(const at::Tensor& input) const;
  // In-place sum of `tensor` over the group.
  void all_reduce_sum(at::Tensor& tensor) const;
  // Copies rank `root`'s `tensor` into every rank's `tensor`.
  void broadcast(at::Tensor& tensor, int root) const;
  void barrier() const;

  // Fail-fast agreement. Runs `local_check` on this rank; it returns this rank's metadata (at
  // most 96 integers) or throws. Then the ranks exchange outcomes in one small
  // collective of a fixed size: if any rank threw, every rank throws the same error (the lowest
  // failing rank's, of the same c10 error type, naming that rank); otherwise returns every
  // rank's metadata, in rank order (amounts may differ: the caller compares them).
  // `purpose` names the round: ranks in rounds of different purposes (an argument given on
  // some ranks only sends them down different paths) raise an error naming each rank's.
  std::vector<std::vector<int64_t>> agree(const std::function<std::vector<int64_t>()>& local_check,
                                          const std::string& purpose = "an agreement") const;

  // Raises `error` on every rank through the agreement round that the other ranks run next
  // (every round has one shape, whatever each rank's check): a mistake only this rank can see
  // fails all ranks alike instead of hanging them in a collective this rank never posts.
  [[noreturn]] void fail_together(const std::exception_ptr& error) const;

  // True when both handles share one process group (e.g. a mesh whose SP group is the world).
  bool operator==(const Group& other) const { return runtime_ == other.runtime_; }
  bool operator!=(const Group& other) const { return runtime_ != other.runtime_; }

  // Collectives issued through this process group (agree counts once per round): for tests
  // and benchmarks.
  int64_t collective_count() const;
  // Wall-clock seconds spent inside collectives issued through this process group, and blocked
  // waiting for its point-to-point transfers (Transfers::wait: what no work hid).
  double collective_seconds() const;
  // From now on, keeps when each collective on this process group begins and ends, dropping
  // what was kept (Note [Waiting for the last rank] in src/transport/group.cpp).
  void keep_collective_times() const;
  // Of this rank's collectives kept since then, the seconds spent waiting for the group's last
  // rank to arrive; keeping starts anew. Two all_gathers, which every rank of the group issues
  // alike; nullopt when the ranks do not share a clock (another host) or did not keep the same
  // collectives.
  std::optional<double> take_waiting_seconds() const;
  // Point-to-point messages and bytes sent by this rank through this process group.
  int64_t p2p_messages_sent() const;
  int64_t p2p_bytes_sent() const;
  // Bytes of freed buffers the group's cache holds now (see GroupOptions::buffer_cache_bytes).
  int64_t cached_buffer_bytes() const;

 private:
  friend detail::SharedMemoryLinks& detail::shared_memory_links(const Group& group);
  friend detail::ArmedAgreement& detail::armed_agreement(const Group& group);
  friend class Transfers;
  Group(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<detail::GroupRuntime> runtime,
        int rank, int size, GroupOptions options);
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;      // Null only for solo().
  std::shared_ptr<detail::GroupRuntime> runtime_;  // Never null.
  int rank_ = 0;                                   // In [0, size_).
  int size_ = 1;                                   // >= 1.
  GroupOptions options_;
};

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

// Runs `prepare` (work that can fail on this rank alone, e.g. parsing its arguments) and
// returns its result; a failure is raised on every rank of `group` through fail_together.
template <typename Fn>
auto fail_together_on_error(const Group& group, Fn&& prepare) {
  try {
    return prepare();
  } catch (const std::exception&) {
    group.fail_together(std::current_exception());
  }
}

// World = DP x SP. SP groups are consecutive blocks of `sp_size` ranks; DP groups take one
// rank of each SP group.
struct Mesh {
  // Creates this rank's group for a partition of the world's ranks into disjoint groups. Every
  // rank calls it with the same partition (as torch.distributed.new_subgroups_by_enumeration).
  using Split = std::function<Group(const std::vector<std::vector<int>>& partition)>;
  // The SP and DP partitions of `world_size` ranks for SP groups of `sp_size` ranks.
  static std::vector<std::vector<int>> sp_partition(int world_size, int sp_size);
  static std::vector<std::vector<int>> dp_partition(int world_size, int sp_size);
  // Builds the sub-groups of this rank through `split`. world.size() must be a multiple of
  // sp_size, and sp_size of ring_size; a sub-group equal to the world (or of one rank) is made
  // without calling `split`. With ring_size R > 1 each SP group splits further into Ulysses
  // groups of U = sp_size / R consecutive ranks and ring groups of R ranks at stride U (see
  // ring_attention.h); with R = 1, ulysses is the SP group and ring a solo group.
  static Mesh create(const Group& world, int sp_size, const Split& split, int ring_size = 1);
  Group world;
  Group sp;
  Group dp;
  Group ulysses;
  Group ring;
};

}  // namespace ulysses
