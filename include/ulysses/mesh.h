// The world as a DP x SP mesh of process groups (Mesh::create), from the partitions of the plan
// floor (mesh_plan.h):
//   sp_group(w) = { (w / P) * P + i : 0 <= i < P },   dp_group(w) = { w % P + j * P : j }.
// With a ring of R ranks, each SP group splits further into Ulysses groups of U = P / R
// consecutive ranks and ring groups of R ranks at stride U (ring_attention.h).
#pragma once

#include <functional>
#include <vector>

#include "ulysses/group.h"

namespace ulysses {

struct Mesh {
  // Creates this rank's group for a partition of the world's ranks into disjoint groups. Every
  // rank calls it with the same partition (as torch.distributed.new_subgroups_by_enumeration).
  using Split = std::function<Group(const std::vector<std::vector<int>>& partition)>;
  // Builds the sub-groups of this rank through `split`. world.size() must be a multiple of
  // sp_size, and sp_size of ring_size (check_mesh_sizes); a sub-group equal to the world (or of
  // one rank) is made without calling `split`. With ring_size 1, ulysses is the SP group and
  // ring a solo group.
  static Mesh create(const Group& world, int sp_size, const Split& split, int ring_size = 1);
  Group world;
  Group sp;
  Group dp;
  Group ulysses;
  Group ring;
};

}  // namespace ulysses
