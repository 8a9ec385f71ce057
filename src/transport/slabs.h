// How a pipelined transfer is cut into messages. Both ends cut alike, so message i of one end is
// message i of the other, and carries tag kFirstMessage + i (message_tags.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ulysses::detail {

// Tokens [first, first + count) of batch entry `batch`.
struct Slab {
  int64_t batch, first, count;
};

// The slabs of `batches` x `tokens` tokens, batch entry by batch entry, each at most
// `max_elements` of `per_token` elements per token (at least one token).
inline std::vector<Slab> slabs(int64_t batches, int64_t tokens, int64_t per_token,
                               int64_t max_elements) {
  std::vector<Slab> out;
  if (per_token == 0) return out;
  const int64_t step = std::max<int64_t>(1, max_elements / per_token);
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t first = 0; first < tokens; first += step) {
      out.push_back({b, first, std::min(step, tokens - first)});
    }
  }
  return out;
}

}  // namespace ulysses::detail
