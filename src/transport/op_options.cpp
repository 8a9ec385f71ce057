#include "transport/op_options.h"

#include <c10/util/Exception.h>

#include <sstream>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace ulysses {
namespace {

// The codec's numbers for the transports (the ops' group_options[4]).
constexpr GroupOptions::Transport kTransports[] = {GroupOptions::Transport::kAuto,
                                                   GroupOptions::Transport::kMessages,
                                                   GroupOptions::Transport::kBatched};

int64_t transport_number(GroupOptions::Transport transport) {
  for (int64_t i = 0; i < 3; ++i)
    if (kTransports[i] == transport) return i;
  TORCH_INTERNAL_ASSERT(false, "an unknown transport");
}

}  // namespace

std::vector<int64_t> options_to_ints(const GroupOptions& options) {
  return {options.timeout ? options.timeout->count() : int64_t{-1}, options.pipeline_min_bytes,
          options.message_bytes,
          options.shared_memory ? int64_t{*options.shared_memory} : int64_t{-1},
          transport_number(options.transport)};
}

GroupOptions options_from_ints(c10::IntArrayRef values) {
  GroupOptions o;
  TORCH_CHECK_VALUE(values.size() <= 5, "Group: group_options has at most 5 values ([timeout ms ",
                    "(-1: the group's own), pipeline_min_bytes, message_bytes, shared_memory (-1: ",
                    "unset), transport]); got ", values.size());
  if (values.size() > 0 && values[0] != -1) {
    TORCH_CHECK_VALUE(
        values[0] > 0,
        "Group: group_options' timeout must be > 0 ms, or -1 for the group's own; got ", values[0]);
    o.timeout = std::chrono::milliseconds(values[0]);
  }
  if (values.size() > 1) o.pipeline_min_bytes = values[1];
  if (values.size() > 2) o.message_bytes = values[2];
  if (values.size() > 3 && values[3] >= 0) o.shared_memory = values[3] != 0;
  if (values.size() > 4) {
    TORCH_CHECK_VALUE(values[4] >= 0 && values[4] <= 2,
                      "Group: group_options' transport must be 0 (auto), 1 (messages) or 2 "
                      "(batched); got ",
                      values[4]);
    o.transport = kTransports[values[4]];
  }
  return o;
}

Group group_of_op(const std::string& name, c10::IntArrayRef options) {
  const GroupOptions o = options_from_ints(options);
  return name.empty() ? Group::solo(o) : Group::resolve(name, o);
}

std::string op_group_name(const Group& group) {
  const c10::intrusive_ptr<c10d::ProcessGroup>& pg = group.process_group();
  if (!pg) return "";
  std::string name = pg->getGroupName();
  try {
    if (!name.empty() && c10d::resolve_process_group(name).get() == pg.get()) return name;
  } catch (const std::exception&) {
  }
  // Handed over by a C++ caller without a registered name: register it under one of ours.
  std::ostringstream os;
  os << "ulysses:" << static_cast<const void*>(pg.get());
  name = os.str();
  try {
    if (c10d::resolve_process_group(name).get() == pg.get()) return name;
  } catch (const std::exception&) {
  }
  c10d::register_process_group(name, pg);
  return name;
}

}  // namespace ulysses
