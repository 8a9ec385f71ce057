// The few libtorch API differences between Debian's 1.13 and PyTorch 2.x, guarded in one place.
#pragma once

#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ulysses::detail {

// Backends (Gloo, NCCL) derive from c10d::ProcessGroup in 1.x and from c10d::Backend in 2.x;
// both expose the same collective signatures we use.
#if TORCH_VERSION_MAJOR >= 2
using C10dBackend = c10d::Backend;
inline constexpr bool kHasPublicSdpa = true;
#else
using C10dBackend = c10d::ProcessGroup;
inline constexpr bool kHasPublicSdpa = false;
#endif

}  // namespace ulysses::detail
