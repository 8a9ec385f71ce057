// How ranks make a mesh: the partitions of a world into SP, DP, Ulysses and ring groups (mesh.h
// builds the groups), and the Ulysses x ring split of an SP group: what one attention layer
// costs each rank under every split U x R = sp (ring_attention.h has the layout), and the
// recommended one. Pure: no tensors, no collectives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ulysses {

// The size rule of a mesh: `world_size` ranks in SP groups of `sp_size`, each of ring groups of
// `ring_size` (1: no ring); throws c10::ValueError naming the sizes (prefixed by `who`) unless
// sp_size divides world_size and ring_size divides sp_size.
void check_mesh_sizes(int64_t world_size, int64_t sp_size, int64_t ring_size, const char* who);

// The partitions of `world_size` ranks (check_mesh_sizes): SP groups of `sp_size` consecutive
// ranks; DP groups of one rank of each SP group; within each SP group, Ulysses groups of
// U = sp_size / ring_size consecutive ranks and ring groups of `ring_size` ranks at stride U.
std::vector<std::vector<int>> sp_partition(int world_size, int sp_size);
std::vector<std::vector<int>> dp_partition(int world_size, int sp_size);
std::vector<std::vector<int>> ulysses_partition(int world_size, int sp_size, int ring_size);
std::vector<std::vector<int>> ring_partition(int world_size, int sp_size, int ring_size);

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
