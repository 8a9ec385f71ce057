// The Ulysses x ring split of an SP group: what one attention layer costs each rank under
// every split U x R = sp (ring_attention.h has the layout), and the recommended one. Pure: no
// tensors, no collectives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ulysses {

// The cost of one attention layer under a U x R split, per rank (see plan_sp_mesh).
struct MeshCost {
  int64_t ulysses = 1, ring = 1;
  int64_t a2a_bytes = 0;      // Sent through all-to-alls, forward + backward.
  int64_t ring_bytes = 0;     // Sent to the ring neighbour, forward + backward.
  int64_t ring_messages = 0;  // Ring sends, forward + backward: (R-1) + (R-1) + R, or 0.
  int64_t peak_bytes = 0;     // Attention activations held at the peak (inputs, a2a results,
                              // kernel output and lse, ring blocks in flight).
  int64_t kv_replicas = 1;    // Copies of each kv head inside a Ulysses group (U > Hkv).
  std::string describe() const;
};

// What a layer needs: heads, sequence, head dim, batch, element size.
struct LayerShape {
  int64_t q_heads = 0, kv_heads = 0, seq_len = 0, head_dim = 64, batch = 1, elem_bytes = 4;
};

// Every valid U x R split of `sp` ranks (U <= Hq, U divides sp), with its cost; the first is
// the recommendation: the fewest bytes moved per layer, ties to the smaller peak memory. Moved
// bytes are what ranks on one network wait for; with this kind of CPU the compute is the same
// for every split, so the bytes decide.
std::vector<MeshCost> plan_sp_mesh(int64_t sp, const LayerShape& shape);

}  // namespace ulysses
