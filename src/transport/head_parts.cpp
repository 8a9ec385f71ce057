#include "transport/head_parts.h"

#include <c10/util/Exception.h>

#include "transport/agreement.h"

namespace ulysses {
namespace {

using detail::shape_str;

// The first of `parts` (one per rank) that does not hold its rank's heads `ranges[j]` in
// `layout` with part 0's other dims, dtype and device; -1 when all fit.
int64_t first_misfit_part(const std::vector<at::Tensor>& parts, const std::vector<Range>& ranges,
                          Layout layout) {
  const int64_t hdim = head_dim(layout);
  for (size_t j = 0; j < parts.size(); ++j) {
    const at::Tensor& p = parts[j];
    bool ok = p.defined() && p.dim() == 4 && p.size(hdim) == ranges[j].size() &&
              p.scalar_type() == parts[0].scalar_type() && p.device() == parts[0].device();
    for (int64_t d = 0; ok && d < 4; ++d) ok = d == hdim || p.size(d) == parts[0].size(d);
    if (!ok) return static_cast<int64_t>(j);
  }
  return -1;
}

}  // namespace

void check_parts(const char* op, const std::vector<at::Tensor>& parts, Heads kind,
                 const Sharding& sharding, const Group& group) {
  const auto& ranges = sharding.ranges(kind);
  TORCH_CHECK_VALUE(parts.size() == ranges.size() && sharding.heads.sp_size() == group.size(), op,
                    ": need one part per rank of the group (", group.size(), "); got ",
                    parts.size());
  const int64_t sdim = seq_dim(sharding.layout), hdim = head_dim(sharding.layout);
  const int64_t tokens = sharding.seq.length(group.rank());
  // Parts that fit have part 0's token count: then part 0's is the one to check.
  int64_t j = first_misfit_part(parts, ranges, sharding.layout);
  if (j < 0 && parts[0].size(sdim) != tokens) j = 0;
  // The message (built only on failure) reads parts[j].
  TORCH_CHECK_VALUE(
      j < 0, op, ": part ", j, " must hold ", ranges[j].size(), " ", heads_word(kind),
      " heads in dim ", hdim, " and ", tokens, " tokens in dim ", sdim, " (layout ",
      to_string(sharding.layout), "), with part 0's dtype, device and other dims; got ",
      parts[j].defined() ? shape_str(parts[j].sizes()) : "undefined", " (rank ", group.rank(), ")");
}

at::Tensor stand_in_for_parts(const std::vector<at::Tensor>& parts, Heads kind,
                              const HeadPartition& partition, Layout layout,
                              const std::string& who) {
  const auto& ranges = kind == Heads::kQuery ? partition.q_ranges() : partition.kv_ranges();
  const int64_t hdim = head_dim(layout);
  TORCH_CHECK_VALUE(parts.size() == ranges.size(), who, " needs one part per rank (", ranges.size(),
                    "); got ", parts.size());
  const int64_t j = first_misfit_part(parts, ranges, layout);
  // The message (built only on failure) reads parts[j].
  TORCH_CHECK_VALUE(j < 0, who, " part ", j, " must be 4-D (", to_string(layout), ") with ",
                    ranges[j].size(), " heads in dim ", hdim,
                    " and part 0's other dims, dtype and device; got ",
                    parts[j].defined() ? shape_str(parts[j].sizes()) : "undefined");
  bool grad = false;
  for (const at::Tensor& p : parts) grad = grad || p.requires_grad();
  std::vector<int64_t> shape = parts[0].sizes().vec();
  shape[hdim] = ranges.back().end;
  return parts[0].new_empty({1, 1, 1, 1}).requires_grad_(grad).expand(shape);
}

}  // namespace ulysses
