// The kernels floor's calls into its dispatcher ops (torch.ops.ulysses, registered in
// src/ops.cpp; Note [One autograd] in ops.h): flash_attention and ring_attention.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "ulysses/attention.h"
#include "ulysses/flash_attention.h"
#include "ulysses/group.h"
#include "ulysses/ring_attention.h"

namespace ulysses::detail {

std::tuple<at::Tensor, at::Tensor> call_flash_attention(const LocalAttentionArgs& args,
                                                        const FlashOptions& options);
std::tuple<at::Tensor, at::Tensor> call_ring_attention(const LocalAttentionArgs& args,
                                                       const RingLayout& layout,
                                                       const at::Tensor& docs, const Group& ring);

}  // namespace ulysses::detail
