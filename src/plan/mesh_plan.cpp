#include "ulysses/mesh_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "ulysses/partition.h"

namespace ulysses {

void check_mesh_sizes(int64_t world_size, int64_t sp_size, int64_t ring_size, const char* who) {
  TORCH_CHECK_VALUE(sp_size >= 1 && world_size % sp_size == 0, who, ": world size (", world_size,
                    ") must be a multiple of the sequence-parallel size (", sp_size, ")");
  TORCH_CHECK_VALUE(ring_size >= 1 && sp_size % ring_size == 0, who, ": the ring size (", ring_size,
                    ") must divide the sequence-parallel size (", sp_size, ")");
}

std::vector<std::vector<int>> sp_partition(int world_size, int sp_size) {
  std::vector<std::vector<int>> groups(world_size / sp_size);
  for (int w = 0; w < world_size; ++w) groups[w / sp_size].push_back(w);
  return groups;
}

std::vector<std::vector<int>> dp_partition(int world_size, int sp_size) {
  std::vector<std::vector<int>> groups(sp_size);
  for (int w = 0; w < world_size; ++w) groups[w % sp_size].push_back(w);
  return groups;
}

std::vector<std::vector<int>> ulysses_partition(int world_size, int sp_size, int ring_size) {
  const int U = sp_size / ring_size;
  std::vector<std::vector<int>> groups;
  for (int base = 0; base < world_size; base += sp_size) {
    for (int r = 0; r < ring_size; ++r) {
      groups.emplace_back();
      for (int u = 0; u < U; ++u) groups.back().push_back(base + r * U + u);
    }
  }
  return groups;
}

std::vector<std::vector<int>> ring_partition(int world_size, int sp_size, int ring_size) {
  const int U = sp_size / ring_size;
  std::vector<std::vector<int>> groups;
  for (int base = 0; base < world_size; base += sp_size) {
    for (int u = 0; u < U; ++u) {
      groups.emplace_back();
      for (int r = 0; r < ring_size; ++r) groups.back().push_back(base + r * U + u);
    }
  }
  return groups;
}

std::string MeshCost::describe() const {
  std::ostringstream os;
  os << ulysses << "x" << ring;
  return os.str();
}

std::vector<MeshCost> plan_sp_mesh(int64_t sp, const LayerShape& s) {
  TORCH_CHECK_VALUE(sp >= 1, "plan_sp_mesh: SP size must be >= 1; got ", sp);
  check_head_counts(s.q_heads, s.kv_heads, "plan_sp_mesh: ");
  TORCH_CHECK_VALUE(s.seq_len >= 0 && s.head_dim >= 1 && s.batch >= 1 && s.elem_bytes >= 1,
                    "plan_sp_mesh: sequence length, head dim, batch and element size must be "
                    "positive");
  std::vector<MeshCost> plans;
  for (int64_t U = 1; U <= sp; ++U) {
    if (sp % U != 0 || U > s.q_heads) continue;
    const int64_t R = sp / U;
    // The zigzag layout (ring_attention.h): 2R even chunks, ring rank r holding chunks r and
    // 2R-1-r, its tokens split evenly over its U Ulysses ranks.
    const SequencePartition chunks = SequencePartition::even(s.seq_len, 2 * R);
    auto ring_length = [&](int64_t r) { return chunks.length(r) + chunks.length(2 * R - 1 - r); };
    const HeadPartition heads = HeadPartition::make(s.q_heads, s.kv_heads, U);
    const int64_t e = s.elem_bytes, D = s.head_dim, B = s.batch;
    MeshCost c;
    c.ulysses = U, c.ring = R;
    c.kv_replicas = U > s.kv_heads ? U / s.kv_heads : 1;
    // The busiest rank: ring rank 0 holds the longest zigzag share; Ulysses rank 0 the most
    // heads and tokens of it.
    for (int64_t p = 0; p < sp; ++p) {
      const int64_t r = p / U, u = p % U, L = ring_length(r);
      const int64_t mine = SequencePartition::even(L, U).length(u);
      const int64_t hq = heads.q_range(u).size(), hkv = heads.kv_range(u).size();
      int64_t a2a = 0;
      if (U > 1) {
        int64_t kv_out = 0;
        for (int64_t w = 0; w < U; ++w)
          if (w != u) kv_out += heads.kv_range(w).size();
        // q out; k and v out; the output back (our heads, others' tokens). Backward mirrors.
        a2a = mine * (s.q_heads - hq) * D + 2 * mine * kv_out * D + (L - mine) * hq * D;
        a2a *= 2 * e * B;
      }
      int64_t ring_bytes = 0, messages = 0;
      for (int64_t t = 0; t + 1 < R; ++t) {  // Forward and backward pass the kv blocks...
        const int64_t src = ((r - t) % R + R) % R;
        ring_bytes += 2 * B * hkv * ring_length(src) * 2 * D * e;
        messages += 2;
      }
      for (int64_t t = 0; t < R && R > 1; ++t) {  // ...and backward their fp32 accumulators.
        const int64_t src = ((r - t) % R + R) % R;
        ring_bytes += B * hkv * ring_length(src) * 2 * D * 4;
        messages += 1;
      }
      // Peak: inputs and output shard, the all-to-all results, the kernel's fp32 output and
      // lse, two kv blocks (one computed on, one arriving).
      const int64_t longest = ring_length(0);
      const int64_t peak =
          B * (mine * (2 * s.q_heads + 2 * s.kv_heads) * D * e + L * (hq + 2 * hkv) * D * e +
               L * hq * (D + 1) * 4 + (R > 1 ? 2 * hkv * longest * 2 * D * e : 0));
      if (a2a + ring_bytes > c.a2a_bytes + c.ring_bytes) {
        c.a2a_bytes = a2a, c.ring_bytes = ring_bytes, c.ring_messages = messages;
      }
      c.peak_bytes = std::max(c.peak_bytes, peak);
    }
    plans.push_back(c);
  }
  std::stable_sort(plans.begin(), plans.end(), [](const MeshCost& x, const MeshCost& y) {
    const int64_t bx = x.a2a_bytes + x.ring_bytes, by = y.a2a_bytes + y.ring_bytes;
    return bx != by ? bx < by : x.peak_bytes < y.peak_bytes;
  });
  return plans;
}

}  // namespace ulysses
