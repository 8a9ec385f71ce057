// The few libtorch API differences between Debian's 1.13 and PyTorch 2.x, guarded in one place.
#pragma once

#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ulysses::detail {

// Backends (Gloo, NCCL) derive from c10d::ProcessGroup in 1.x and from c10d::Backend in 2.x;
// both expose the same collective signatures we use.
#if TORCH_VERSION_MAJOR >= 2
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

// at::scaled_dot_product_attention is public from 2.0 (1.13 has only the private
// aten::_scaled_dot_product_attention). Its `scale` argument arrived in 2.1, so callers
// pre-scale q.
#if TORCH_VERSION_MAJOR >= 2
inline constexpr bool kHasPublicSdpa = true;
inline at::Tensor public_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const c10::optional<at::Tensor>& mask, bool causal) {
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal);
}
#else
inline constexpr bool kHasPublicSdpa = false;
inline at::Tensor public_sdpa(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "scaled_dot_product_attention needs libtorch >= 2.0");
}
#endif

}  // namespace ulysses::detail
