#include "ulysses/group.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "transport/group_runtime.h"
#include "transport/wait.h"
#include "ulysses/collective_recorder.h"

namespace ulysses {
namespace {

void check_options(const GroupOptions& options) {
  TORCH_CHECK_VALUE(!options.timeout || options.timeout->count() > 0,
                    "Group: timeout must be > 0 ms (or unset: the group's own); got ",
                    options.timeout ? options.timeout->count() : 0, " ms");
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

// The process group's own wait: the longest timeout among its backends' options, else
// kDefaultTimeout (a backend that keeps no options shows none).
std::chrono::milliseconds own_timeout(c10d::ProcessGroup* pg) {
  std::chrono::milliseconds longest{0};
  if (pg != nullptr) {
    for (const c10::Device& device : pg->getDeviceTypes()) {
      try {
        const auto backend = pg->getBackend(device.type());
        if (const auto options = backend->getBackendOptions())
          longest = std::max(longest, options->timeout);
      } catch (const std::exception&) {
      }
    }
  }
  return longest.count() > 0 ? longest : kDefaultTimeout;
}

}  // namespace

Group::Group(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<GroupRuntime> runtime,
             int rank, int size, GroupOptions options)
    : pg_(std::move(pg)),
      runtime_(std::move(runtime)),
      rank_(rank),
      size_(size),
      options_(options),
      timeout_(options.timeout ? *options.timeout : own_timeout(pg_.get())) {}

Group Group::from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                const GroupOptions& options) {
  TORCH_CHECK_VALUE(process_group, "Group::from_process_group: process_group must not be null");
  check_options(options);
  auto runtime = GroupRuntime::of(process_group, options.buffer_cache_bytes);
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
  return Group({}, std::make_shared<GroupRuntime>(options.buffer_cache_bytes), 0, 1, options);
}

Group Group::with_options(const GroupOptions& options) const {
  check_options(options);
  return Group(pg_, runtime_, rank_, size_, options);
}

std::string Group::name() const { return pg_ ? pg_->getGroupName() : std::string(); }
CollectiveRecorder& Group::recorder() const { return runtime_->recorder; }
int64_t Group::cached_buffer_bytes() const { return runtime_->buffers->cached(); }

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

at::Tensor Group::new_buffer(at::IntArrayRef shape, const at::TensorOptions& options) const {
  const size_t bytes = c10::multiply_integers(shape) * options.dtype().itemsize();
  if (!options.device().is_cpu() || static_cast<int64_t>(bytes) < options_.buffer_cache_min_bytes)
    return at::empty(shape, options);
  std::shared_ptr<BufferCache> cache = runtime_->buffers;
  void* p = cache->take(bytes);
  return at::from_blob(p, shape, [cache, bytes](void* q) { cache->give_back(q, bytes); }, options);
}

void Group::all_to_all(at::Tensor& output, at::Tensor& input,
                       const std::vector<int64_t>& output_splits,
                       const std::vector<int64_t>& input_splits) const {
  TORCH_INTERNAL_ASSERT(output.dim() == 1 && input.dim() == 1 && output.is_contiguous() &&
                        input.is_contiguous());
  NoPythonObjectsInWork no_python;
  CollectiveRecorder::Scope scope(runtime_->recorder);
  if (size() == 1) {
    output.copy_(input);
    return;
  }
  std::vector<int64_t> out_splits = output_splits, in_splits = input_splits;
  at::Tensor out = for_work(output), in = for_work(input);
  wait(*this, "all_to_all", pg_->alltoall_base(out, in, out_splits, in_splits), scope.number(),
       output.device().type(), &output_splits, &input_splits);
}

at::Tensor Group::all_gather(const at::Tensor& input) const {
  NoPythonObjectsInWork no_python;
  CollectiveRecorder::Scope scope(runtime_->recorder);
  at::Tensor in = input.contiguous();
  if (size() == 1) return in.unsqueeze(0).clone();
  at::Tensor out = at::empty({size(), in.numel()}, in.options());
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int i = 0; i < size(); ++i) outputs[0].push_back(for_work(out[i]));
  std::vector<at::Tensor> inputs{for_work(in.view({-1}))};
  wait(*this, "all_gather", pg_->allgather(outputs, inputs), scope.number(), in.device().type());
  std::vector<int64_t> shape{size()};
  for (int64_t s : in.sizes()) shape.push_back(s);
  return out.view(shape);
}

void Group::all_reduce_sum(at::Tensor& tensor) const {
  NoPythonObjectsInWork no_python;
  CollectiveRecorder::Scope scope(runtime_->recorder);
  if (size() == 1) return;
  std::vector<at::Tensor> tensors{for_work(tensor)};
  wait(*this, "all_reduce", pg_->allreduce(tensors), scope.number(), tensor.device().type());
}

void Group::broadcast(at::Tensor& tensor, int root) const {
  NoPythonObjectsInWork no_python;
  CollectiveRecorder::Scope scope(runtime_->recorder);
  if (size() == 1) return;
  std::vector<at::Tensor> tensors{for_work(tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  wait(*this, "broadcast", pg_->broadcast(tensors, opts), scope.number(), tensor.device().type());
}

void Group::barrier() const {
  NoPythonObjectsInWork no_python;
  CollectiveRecorder::Scope scope(runtime_->recorder);
  if (size() == 1) return;
  // A barrier holds the host on every backend: timed as CPU work.
  wait(*this, "barrier", pg_->barrier(), scope.number(), c10::DeviceType::CPU);
}

}  // namespace ulysses
