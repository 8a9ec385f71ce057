// Multi-rank test harness: ranks are threads in this process with real Gloo process groups on
// 127.0.0.1, created through torch.distributed (tests/thread_groups.py, run by an embedded
// interpreter) and found by name, as PyTorch's ProcessGroupGlooTest does with a shared store.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ulysses/group.h"
#include "ulysses/mesh.h"
#include "ulysses/partition.h"

namespace ulysses::testing {

// Runs `body(group)` on `world` ranks, one thread each, and returns each rank's error message
// ("" when the rank finished cleanly). Collectives time out after `timeout`.
std::vector<std::string> run_ranks(int world, const std::function<void(Group&)>& body,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(30));

// A Mesh::Split for the thread ranks of `world` (a group from run_ranks): the first rank to
// ask for a partition creates every group of it; each rank gets its own.
Mesh::Split thread_split(const Group& world);

// Sets up `g`'s shared-memory links (two all_gathers, which every rank issues), so that a count
// of collectives after it holds no one-time set-up (a group's first exchange makes them).
void set_up_links(const Group& g);

// Two ranks with a 2.5 s timeout: both run `setup(group)` (which returns the group to use), then
// rank 0 runs `body` on it while rank 1 sleeps 5 s instead. Returns rank 0's error (rank 1's must
// be "") and what was logged meanwhile: how a wait for an absent peer ends.
struct AbsentPeerRun {
  std::string error, log;
};
AbsentPeerRun run_with_absent_peer(const std::function<Group(Group&)>& setup,
                                   const std::function<void(const Group&)>& body);

// Runs `body` on `world` ranks and fails the test with every rank's error, if any.
void expect_ranks_succeed(int world, const std::function<void(Group&)>& body);

// Expects every rank to fail with a message containing `needle`, all messages identical.
void expect_ranks_fail_alike(const std::vector<std::string>& errors, const std::string& needle);

// Max |a - b| / max(max|b|, floor): relative error, absolute where the reference is below
// `floor` (a gradient that is exactly 0 in exact arithmetic, for example).
double rel_error(const at::Tensor& a, const at::Tensor& b, double floor = 1e-30);

// Standard normal values from a generator seeded with `seed`: reproducible on every rank
// thread without touching the global generator.
at::Tensor seeded_randn(at::IntArrayRef shape, uint64_t seed);

// The shape of a full (single-rank) tensor with S tokens and H heads in `layout`.
std::vector<int64_t> full_shape(Layout layout, int64_t B, int64_t S, int64_t H, int64_t D);

// Context for failure messages: rank, world, dtype and shape.
std::string where(const Group& g, const at::Tensor& t);

// Watches `out`'s bytes from a hook on its node that runs right after the node's backward,
// before the engine releases the node: the flag says whether they were gone by then (a node
// that freed them as it ran, not with its saved state afterwards).
std::shared_ptr<bool> freed_when_its_node_ran(const at::Tensor& out);

}  // namespace ulysses::testing
