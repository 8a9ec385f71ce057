#include "ulysses/mesh.h"

#include "ulysses/mesh_plan.h"

namespace ulysses {

Mesh Mesh::create(const Group& world, int sp_size, const Split& split, int ring_size) {
  check_mesh_sizes(world.size(), sp_size, ring_size, "Mesh::create");
  const int n = world.size();
  auto make = [&](const std::vector<std::vector<int>>& partition) {
    if (partition.size() == 1) return world;
    if (partition[0].size() == 1) return Group::solo(world.options());
    return split(partition).with_options(world.options());
  };
  Group sp = make(sp_partition(n, sp_size));
  Group dp = make(dp_partition(n, sp_size));
  if (ring_size == 1) return Mesh{world, sp, dp, sp, Group::solo(world.options())};
  return Mesh{world, sp, dp, make(ulysses_partition(n, sp_size, ring_size)),
              make(ring_partition(n, sp_size, ring_size))};
}

}  // namespace ulysses
