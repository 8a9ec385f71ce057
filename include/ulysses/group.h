// Process groups for sequence parallelism, over PyTorch's c10d.
//
// A Group wraps a c10d::ProcessGroup made by torch.distributed (init_process_group, new_group,
// DeviceMesh) and found by its group name, or handed over by a C++ caller. Gloo carries CPU
// tensors, NCCL CUDA tensors: the ProcessGroup dispatches by the tensors' device. Every handle
// of one process group shares its runtime: a cache of freed buffers, the recorder of what its
// collectives cost (collective_recorder.h), and the state its exchanges keep between calls.
//
// Note [Waits]: who bounds a wait depends on where the tensors live.
// - CPU tensors (Gloo): the op waits on the host, at most GroupOptions::timeout, and logs which
//   collective and peers it waits for after GroupOptions::log_wait_fraction of it: a dead or
//   absent peer is an error, not a hang.
// - Device tensors (NCCL): the op enqueues its collectives and returns; Work::wait() with no
//   timeout orders the current stream after them without holding the host. NCCL's watchdog
//   bounds them, with the timeout given to init_process_group (a timed wait there would block
//   the host until the kernel ends and, on expiry, abort the communicator).
// `agree` is the fail-fast step: ranks exchange the outcome of their local checks before any
// data moves, so an invalid setup raises the same error on every rank.
#pragma once

#include <ATen/ATen.h>
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

// Options of a Group handle. The environment (ULYSSES_SHARED_MEMORY, ULYSSES_TRANSPORT) fills in
// what is left unset, read where a call uses it.
struct GroupOptions {
  // Longest wait for any collective, in milliseconds; > 0 when set. A peer silent this long is
  // an error. Unset: the process group's own (Group::timeout), so a rank late by less than the
  // job allows (a checkpoint, an evaluation, a first compile) never ends it here.
  std::optional<std::chrono::milliseconds> timeout;
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
  // Ulysses all-to-alls of CPU tensors between ranks not all on one host (else see
  // `shared_memory`) that send at least this many bytes to other ranks go as point-to-point
  // messages of about `message_bytes` each: packing message i+1 overlaps the transfer of message
  // i, blocks that land contiguously are received in place, and this rank's own block is copied
  // straight across. Smaller exchanges (and other devices, and the batched transport) take one
  // collective, where a message's fixed cost would dominate. >= 0 and > 0.
  int64_t pipeline_min_bytes = int64_t{4} << 20;
  int64_t message_bytes = int64_t{4} << 20;
  // CPU exchanges with ranks on this host go through shared memory (/dev/shm): the sender packs
  // its blocks into a file the receiver maps, and the receiver copies them out. When every rank
  // of the group is on this host, every such exchange, whatever its size, hands over with flags
  // in those files and no message at all (one collective counted), through two windows of
  // about `message_bytes` in all, round after round, so each file stays that small whatever the
  // exchange's size; otherwise pipelined exchanges send co-located ranks their blocks so (each
  // file then holds an exchange's blocks for them) and the others as messages. Ranks in other
  // network namespaces count as other hosts. The first exchange of a group sets its links up with
  // two all_gathers, counted once per group (docs/benchmarks.md has its speed). Where /dev/shm
  // cannot hold a rank's outbox, its blocks go as messages or collectives instead (one
  // warning), exact. Unset: on, unless ULYSSES_SHARED_MEMORY is 0. Not for the batched transport.
  std::optional<bool> shared_memory;
  // How point-to-point transfers are posted. NCCL matches sends and receives between two ranks
  // in the order they are posted, whatever their tags, and runs unbatched ones one by one on a
  // stream: a receive posted before its peer's send waits forever there. Batched, the transfers
  // of one step are posted together (one coalesced group where the backend has them, as
  // torch.distributed.batch_isend_irecv does), and whole-tensor exchanges always take one
  // collective. kAuto: ULYSSES_TRANSPORT=auto|messages|batched when set, else batched where the
  // backend coalesces (NCCL) and messages elsewhere (Gloo). Messages apply to CPU tensors only:
  // transfers of other devices' tensors are always batched.
  enum class Transport { kAuto, kMessages, kBatched };
  Transport transport = Transport::kAuto;
};

// The wait of a group whose backends show none (a solo group, a backend without options).
constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::seconds(120)};

// "auto", "messages" or "batched"; parse_transport raises c10::ValueError on any other text.
std::string to_string(GroupOptions::Transport transport);
GroupOptions::Transport parse_transport(const std::string& text);

class CollectiveRecorder;
// The state every handle of one process group shares (src/transport/group_runtime.h).
class GroupRuntime;

// A handle to one process group: cheap to copy (copies share the connection and its runtime).
class Group {
 public:
  // Wraps `process_group` (never null). Runtime state (buffer cache, recorder) is shared by
  // every handle of the same process group.
  static Group from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                  const GroupOptions& options = {});
  // The process group torch.distributed registered under `name` (its `group_name`; see
  // c10d::resolve_process_group). Throws c10::ValueError naming `name` if there is none.
  static Group resolve(const std::string& name, const GroupOptions& options = {});
  // A group of this rank alone: every collective is a local copy.
  static Group solo(const GroupOptions& options = {});

  int rank() const { return rank_; }
  int size() const { return size_; }
  const GroupOptions& options() const { return options_; }
  // The longest wait of this handle's collectives: options().timeout when set, else the process
  // group's own, the longest timeout among its backends' options (what init_process_group or
  // new_group was given: Gloo's 30 minutes, NCCL's 10, unless the job set one), else
  // kDefaultTimeout.
  std::chrono::milliseconds timeout() const { return timeout_; }
  // The same group with other options (same connection and runtime).
  Group with_options(const GroupOptions& options) const;
  // The c10d group name ("" for solo()).
  std::string name() const;
  // The wrapped process group (null for solo()).
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }
  // What this process group's collectives and transfers cost so far (every handle's).
  CollectiveRecorder& recorder() const;
  // The state every handle of this process group shares.
  GroupRuntime& runtime() const { return *runtime_; }

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
  // Bytes of freed buffers the group's cache holds now (see GroupOptions::buffer_cache_bytes).
  int64_t cached_buffer_bytes() const;

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

 private:
  Group(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<GroupRuntime> runtime, int rank,
        int size, GroupOptions options);
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;  // Null only for solo().
  std::shared_ptr<GroupRuntime> runtime_;      // Never null.
  int rank_ = 0;                               // In [0, size_).
  int size_ = 1;                               // >= 1.
  GroupOptions options_;
  std::chrono::milliseconds timeout_;  // options_.timeout, else the process group's own; > 0.
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

}  // namespace ulysses
