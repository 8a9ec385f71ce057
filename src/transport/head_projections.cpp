// The projections that make and take head parts (all_to_all.h): one GEMM per rank.
#include <c10/util/Exception.h>

#include "transport/agreement.h"
#include "ulysses/all_to_all.h"

namespace ulysses {
namespace {

using detail::shape_str;

// The shape rules of the two projections (raising c10::ValueError with the shapes).
void check_head_projection(const std::vector<int64_t>& x, const std::vector<int64_t>& weight,
                           const c10::optional<std::vector<int64_t>>& bias,
                           const std::vector<Range>& ranges) {
  const int64_t H = ranges.empty() ? 0 : ranges.back().end;
  TORCH_CHECK_VALUE(x.size() == 3 && weight.size() == 2 && H > 0 && weight[0] % H == 0 &&
                        weight[1] == x[2] && (!bias || *bias == std::vector<int64_t>{weight[0]}),
                    "project_head_parts: need x [B, S, E], weight [H x D, E] for the ", H,
                    " heads of the ranges and bias [H x D] or none; got x ", c10::IntArrayRef(x),
                    ", weight ", c10::IntArrayRef(weight), bias ? ", bias " : "",
                    bias ? shape_str(*bias) : "");
}

void check_projection_from_parts(const std::vector<std::vector<int64_t>>& parts,
                                 const std::vector<int64_t>& weight,
                                 const std::vector<Range>& ranges) {
  TORCH_CHECK_VALUE(!parts.empty() && parts.size() == ranges.size() && weight.size() == 2,
                    "project_from_head_parts: need one part per head range and a 2-D weight; got ",
                    parts.size(), " parts, ", ranges.size(), " ranges, weight ",
                    c10::IntArrayRef(weight));
  const int64_t H = ranges.back().end;
  for (size_t j = 0; j < parts.size(); ++j) {
    const auto& p = parts[j];
    TORCH_CHECK_VALUE(p.size() == 4 && p[2] == ranges[j].size() && weight[1] % H == 0 &&
                          weight[1] / H == p[3] && p[0] == parts[0][0] && p[1] == parts[0][1],
                      "project_from_head_parts: part ", j, " must be [B, S, ", ranges[j].size(),
                      ", D] with D = weight's columns / heads and part 0's B and S; got ",
                      c10::IntArrayRef(p), " and weight ", c10::IntArrayRef(weight));
  }
}

}  // namespace

std::vector<at::Tensor> project_head_parts(const at::Tensor& x, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias,
                                           const std::vector<Range>& ranges) {
  check_head_projection(
      x.sizes().vec(), weight.sizes().vec(),
      bias ? c10::optional<std::vector<int64_t>>(bias->sizes().vec()) : c10::nullopt, ranges);
  const int64_t D = weight.size(0) / ranges.back().end;
  std::vector<at::Tensor> parts;
  for (const Range& r : ranges) {
    const at::Tensor w = weight.narrow(0, r.begin * D, r.size() * D);
    const c10::optional<at::Tensor> b =
        bias ? c10::optional<at::Tensor>(bias->narrow(0, r.begin * D, r.size() * D)) : c10::nullopt;
    parts.push_back(at::linear(x, w, b).view({x.size(0), x.size(1), r.size(), D}));
  }
  return parts;
}

at::Tensor project_from_head_parts(const std::vector<at::Tensor>& parts, const at::Tensor& weight,
                                   const std::vector<Range>& ranges) {
  std::vector<std::vector<int64_t>> sizes;
  for (const at::Tensor& p : parts) sizes.push_back(p.sizes().vec());
  check_projection_from_parts(sizes, weight.sizes().vec(), ranges);
  at::Tensor out;
  for (size_t j = 0; j < parts.size(); ++j) {
    const at::Tensor& p = parts[j];
    const int64_t D = p.size(3);
    const at::Tensor y =
        at::linear(p.flatten(2), weight.narrow(1, ranges[j].begin * D, p.size(2) * D));
    out = out.defined() ? out + y : y;
  }
  return out;
}

}  // namespace ulysses
