// The one rule for dtypes on the wire. Collectives that only move bytes (all-to-all,
// all-gather) send a dtype Gloo lacks as one of the same width that it has: bool as uint8,
// bf16 as fp16. Receive into a buffer viewed the same way; the bytes are unchanged.
#pragma once

#include <ATen/ATen.h>

namespace ulysses::detail {

inline at::Tensor wire_view(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBool:
      return t.view(at::kByte);
    case at::kBFloat16:
      return t.view(at::kHalf);
    default:
      return t;
  }
}

}  // namespace ulysses::detail
