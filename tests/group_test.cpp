#include "ulysses/group.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/FakeProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "testing.h"
#include "transport/transfers.h"
#include "ulysses/collective_recorder.h"
#include "ulysses/mesh.h"

namespace ulysses {
namespace {

using testing::expect_ranks_fail_alike;
using testing::expect_ranks_succeed;
using testing::run_ranks;
using testing::run_with_absent_peer;

TEST(Group, AllGatherAndAllReduce) {
  expect_ranks_succeed(3, [](Group& g) {
    at::Tensor mine = at::full({2}, g.rank(), at::kLong);
    at::Tensor all = g.all_gather(mine);
    ASSERT_EQ(all.sizes(), (std::vector<int64_t>{3, 2}));
    for (int r = 0; r < 3; ++r) EXPECT_EQ(all[r][1].item<int64_t>(), r);
    at::Tensor sum = at::ones({4});
    g.all_reduce_sum(sum);
    EXPECT_TRUE(sum.equal(at::full({4}, 3.0)));
  });
}

// Note [Waiting for the last rank]: a rank that arrives first waits out the late rank's delay;
// the late rank waits for nobody. Collectives before keep_collective_times are not counted.
TEST(Group, WaitingSecondsCountTheWaitForTheLastRankOnly) {
  constexpr double kDelay = 0.3;  // Rank 1 arrives this much later.
  std::vector<double> waited(2, -1.0);
  expect_ranks_succeed(2, [&](Group& g) {
    at::Tensor x = at::ones({8});
    if (g.rank() == 0) std::this_thread::sleep_for(std::chrono::duration<double>(kDelay));
    g.all_reduce_sum(x);  // Not kept: rank 1 waits here, before keeping starts.
    g.recorder().keep_times();
    g.barrier();
    if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::duration<double>(kDelay));
    g.all_reduce_sum(x);
    const std::optional<double> w = g.recorder().take_waiting_seconds(g);
    ASSERT_TRUE(w.has_value());  // Threads of one process share the clock.
    waited[g.rank()] = *w;
    // Keeping went on: the next interval holds the two all_gathers of the take, and no sleep.
    const std::optional<double> next = g.recorder().take_waiting_seconds(g);
    ASSERT_TRUE(next.has_value());
    EXPECT_LT(*next, kDelay / 2);
  });
  EXPECT_GT(waited[0], kDelay / 2);  // The barrier's ranks leave within far less than kDelay.
  EXPECT_LT(waited[1], kDelay / 2);
  EXPECT_GE(waited[1], 0.0);
}

TEST(Group, BufferCacheReusesSizesAndEvictsTheLeastRecentlyFreed) {
  GroupOptions options;
  options.buffer_cache_bytes = 3 << 20;
  options.buffer_cache_min_bytes = 0;
  const Group g = Group::solo(options);
  const auto mib = [&](int64_t quarters) {  // A float buffer of quarters / 4 MiB.
    return g.new_buffer({quarters << 16}, at::kFloat);
  };
  { at::Tensor a = mib(4), b = mib(8); }  // 1 MiB freed, then 2 MiB: 3 MiB cached.
  EXPECT_EQ(g.cached_buffer_bytes(), 3 << 20);
  { at::Tensor c = mib(4); }  // Taken from the cache and given back.
  EXPECT_EQ(g.cached_buffer_bytes(), 3 << 20);
  {
    at::Tensor d = mib(6);  // A new size (another sequence length): 1.5 MiB.
    EXPECT_EQ(g.cached_buffer_bytes(), 3 << 20);
  }
  // It is kept; the least recently freed buffer (2 MiB) makes room for it.
  EXPECT_EQ(g.cached_buffer_bytes(), 5 << 19);
  { at::Tensor e = mib(6); }  // Reused.
  EXPECT_EQ(g.cached_buffer_bytes(), 5 << 19);
  { at::Tensor f = mib(16); }  // Larger than the whole cache: returned, nothing evicted.
  EXPECT_EQ(g.cached_buffer_bytes(), 5 << 19);
}

TEST(Group, BuffersBelowTheCacheMinimumUseTheDefaultAllocator) {
  GroupOptions options;
  options.buffer_cache_min_bytes = 2 << 20;
  const Group g = Group::solo(options);
  { at::Tensor small = g.new_buffer({(1 << 20) / 4}, at::kFloat); }  // 1 MiB: not cached.
  EXPECT_EQ(g.cached_buffer_bytes(), 0);
  { at::Tensor large = g.new_buffer({(2 << 20) / 4}, at::kFloat); }  // 2 MiB: cached.
  EXPECT_EQ(g.cached_buffer_bytes(), 2 << 20);
  options.buffer_cache_min_bytes = -1;
  EXPECT_THROW(Group::solo(options), c10::ValueError);
}

TEST(Group, AgreeReturnsEveryRanksMetadata) {
  expect_ranks_succeed(3, [](Group& g) {
    auto meta = g.agree([&] { return std::vector<int64_t>{g.rank(), 10 * g.rank()}; });
    ASSERT_EQ(meta.size(), 3u);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(meta[r], (std::vector<int64_t>{r, 10 * r}));
  });
}

TEST(Group, AgreeRaisesTheSameErrorOfTheSameTypeOnEveryRank) {
  auto errors = run_ranks(4, [](Group& g) {
    try {
      g.agree([&] {
        TORCH_CHECK_VALUE(g.rank() != 2 && g.rank() != 3, "check: rank ", g.rank(), " is bad");
        return std::vector<int64_t>{};
      });
    } catch (const c10::ValueError&) {
      throw;  // The expected type: rethrown for the message check below.
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "wrong exception type: ", e.what());
    }
  });
  expect_ranks_fail_alike(errors, "check: rank 2 is bad [raised on rank 2 of 4]");
}

TEST(Group, AgreeWithDifferentAmountsOfMetadataReturnsEachRanks) {
  // Gloo aborts the process on an all-gather of mismatched sizes: the agreement round must
  // never post one, whatever each rank's metadata; every rank gets every rank's values.
  expect_ranks_succeed(3, [](Group& g) {
    auto all = g.agree([&] { return std::vector<int64_t>(1 + g.rank(), 7); });
    for (int r = 0; r < 3; ++r) EXPECT_EQ(all[r], std::vector<int64_t>(1 + r, 7));
  });
}

TEST(Group, RoundsOfDifferentPurposesFailAlikeNamingEachRanks) {
  auto errors = run_ranks(2, [](Group& g) {
    g.agree([] { return std::vector<int64_t>{1}; }, g.rank() == 0 ? "round A" : "round B");
  });
  expect_ranks_fail_alike(errors,
                          "ranks are in different agreement rounds: rank 0 in round A, rank 1 in "
                          "round B");
}

// Time blocked on a point-to-point transfer is communication time, as a collective's is (the
// pipelined exchange and the ring run on Transfers): collective_seconds counts it, while
// collective_count still counts collectives only.
TEST(Group, WaitsForTransfersCountAsCollectiveTime) {
  constexpr double kDelay = 0.3;  // The sender's lateness.
  expect_ranks_succeed(2, [&](Group& g) {
    g.barrier();
    const double seconds = g.recorder().seconds();
    const int64_t count = g.recorder().collectives();
    Transfers io(g, c10::DeviceType::CPU);
    at::Tensor got = at::zeros({4});
    if (g.rank() == 0) {
      const size_t n = io.receive(got, 1, 3);
      io.wait(n);
      EXPECT_TRUE(got.equal(at::full({4}, 2.0)));
      EXPECT_GT(g.recorder().seconds() - seconds, kDelay / 2);
    } else {
      std::this_thread::sleep_for(std::chrono::duration<double>(kDelay));
      io.send(at::full({4}, 2.0), 0, 3);
      io.wait();
    }
    EXPECT_EQ(g.recorder().collectives(), count);
  });
}

// A backend that keeps every tensor it is handed, as a Work the worker thread drops last would.
class KeepingBackend : public c10d::Backend {
 public:
  KeepingBackend() : c10d::Backend(0, 2) {}
  const std::string getBackendName() const override { return "keeping"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t,
                                           const c10d::AllreduceOptions&) override {
    return keep(t);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t,
                                           const c10d::BroadcastOptions&) override {
    return keep(t);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                           std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions&) override {
    for (auto& o : out) keep(o);
    return keep(in);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>&, std::vector<int64_t>&,
                                               const c10d::AllToAllOptions&) override {
    std::vector<at::Tensor> both{out, in};
    return keep(both);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int, int) override {
    return keep(t);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int, int) override {
    return keep(t);
  }
  std::vector<at::Tensor> kept;

 private:
  c10::intrusive_ptr<c10d::Work> keep(const std::vector<at::Tensor>& t) {
    kept.insert(kept.end(), t.begin(), t.end());
    return c10::make_intrusive<c10d::FakeWork>();
  }
};

// A collective hands c10d its own TensorImpl over the caller's memory (for_work), so a Work
// freed last on the backend's thread never frees a tensor Python owns: the caller's tensor is
// referenced by nothing the backend keeps, not even as a view's base.
TEST(Group, CollectivesKeepNoReferenceToTheCallersTensors) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(0, 2);
  auto backend = c10::make_intrusive<KeepingBackend>();
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  GroupOptions options;
  options.transport = GroupOptions::Transport::kMessages;
  options.shared_memory = false;
  const Group g = Group::from_process_group(pg, options);
  at::Tensor x = at::ones({4}), y = at::zeros({4});
  const size_t refs = x.use_count();
  g.all_reduce_sum(x);
  g.broadcast(x, 0);
  (void)g.all_gather(x);
  g.all_to_all(y, x, {2, 2}, {2, 2});
  {
    Transfers io(g, c10::DeviceType::CPU);
    io.send(x, 1, 0);
    io.wait();
  }
  ASSERT_EQ(backend->kept.size(), 8);  // all_gather: 2 outputs and 1 input.
  EXPECT_EQ(x.use_count(), refs);
  EXPECT_EQ(y.use_count(), refs);
  for (const at::Tensor& t : backend->kept) {
    EXPECT_FALSE(t.is_same(x) || t.is_same(y));
    EXPECT_FALSE(t.is_view());
  }
  const at::Tensor& sent = backend->kept.back();
  EXPECT_EQ(sent.data_ptr(), x.data_ptr());  // The same memory, not a copy.
}

// The transport is chosen in one place (Group::batches): auto follows the backend (Gloo does
// not coalesce: messages), the options override it on CPU tensors, other devices' transfers are
// always batched; transfers posted either way arrive alike.
TEST(Group, TransportFollowsTheBackendUnlessTheOptionsSayOtherwise) {
  expect_ranks_succeed(2, [](Group& world) {
    using Transport = GroupOptions::Transport;
    for (Transport t : {Transport::kAuto, Transport::kMessages, Transport::kBatched}) {
      GroupOptions options = world.options();
      options.transport = t;
      const Group g = world.with_options(options);
      EXPECT_EQ(batches(g, c10::DeviceType::CPU), t == Transport::kBatched) << to_string(t);
      // Off the CPU nothing is posted unbatched (NCCL would wait forever), messages included.
      EXPECT_TRUE(batches(g, c10::DeviceType::CUDA)) << to_string(t);
      // Both ranks add a receive before their send: NCCL's order, posted batched or not.
      at::Tensor got = at::zeros({3});
      Transfers step(g, c10::DeviceType::CPU);
      EXPECT_EQ(step.batched(), t == Transport::kBatched);
      const int peer = 1 - g.rank();
      const size_t n = step.receive(got, peer, 5);
      step.send(at::full({3}, 10.0 + g.rank()), peer, 5);
      step.post();
      step.wait(n);
      EXPECT_TRUE(got.equal(at::full({3}, 10.0 + peer))) << to_string(t);
    }
  });
  EXPECT_EQ(parse_transport("batched"), GroupOptions::Transport::kBatched);
  EXPECT_THROW(
      {
        try {
          parse_transport("nccl");
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("must be auto, messages or batched; got 'nccl'"),
                    std::string::npos);
          throw;
        }
      },
      c10::ValueError);
}

TEST(Group, MeshSpGroupsAreConsecutiveRanks) {
  expect_ranks_succeed(4, [](Group& world) {
    Mesh mesh = Mesh::create(world, 2, testing::thread_split(world));
    EXPECT_EQ(mesh.sp.size(), 2);
    EXPECT_EQ(mesh.dp.size(), 2);
    at::Tensor w = at::full({1}, world.rank(), at::kLong);
    at::Tensor sp = mesh.sp.all_gather(w).view({-1});
    at::Tensor dp = mesh.dp.all_gather(w).view({-1});
    const int64_t base = world.rank() / 2 * 2;
    EXPECT_TRUE(sp.equal(at::tensor({base, base + 1})));
    EXPECT_TRUE(dp.equal(at::tensor(std::vector<int64_t>{world.rank() % 2, world.rank() % 2 + 2})));
  });
}

TEST(Group, MeshRejectsIndivisibleWorld) {
  auto errors =
      run_ranks(3, [](Group& world) { Mesh::create(world, 2, testing::thread_split(world)); });
  expect_ranks_fail_alike(errors,
                          "world size (3) must be a multiple of the sequence-parallel size (2)");
}

TEST(Group, RejectsInvalidOptions) {
  GroupOptions options;
  options.message_bytes = 0;
  EXPECT_THROW(
      {
        try {
          Group::solo(options);
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("message_bytes > 0; got 4194304 and 0"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::ValueError);
}

TEST(Group, AbsentPeerIsAnErrorNotAHangAndTheWaitIsLogged) {
  // The 2.5 s wait given to the handle, and the same as the process group's own (Note [Waits]).
  const std::function<Group(Group&)> handles[] = {
      [](Group& g) { return g; },
      [](Group& g) { return Group::from_process_group(g.process_group()); }};
  for (const auto& handle : handles) {
    const auto run = run_with_absent_peer(handle, [](const Group& g) {
      at::Tensor t = at::ones({8});
      g.all_reduce_sum(t);
    });
    EXPECT_NE(run.error.find("collective all_reduce #1 failed on rank 0 of 2 (timeout 2500 ms"),
              std::string::npos)
        << run.error;
    // After a quarter of its timeout (GroupOptions::log_wait_fraction) rank 0 said where it waits.
    EXPECT_NE(run.log.find("rank 0 of 2 has waited 0.6 s of its 2.5 s timeout in all_reduce #1 of "
                           "group"),
              std::string::npos)
        << run.log;
    EXPECT_NE(run.log.find("for ranks 1\n"), std::string::npos) << run.log;
  }
}

// Note [Waits]: a handle given no timeout waits as long as its process group's backends allow
// (run_ranks makes them with the timeout it is given), not a fixed 120 s: a rank late by less
// than that is no error (and an absent one fails at that bound: the test above).
TEST(Group, WithoutATimeoutAWaitIsTheProcessGroupsOwn) {
  using std::chrono::milliseconds;
  auto errors = run_ranks(
      2,
      [](Group& world) {
        const Group own = Group::from_process_group(world.process_group());
        EXPECT_EQ(own.timeout(), milliseconds(2500));
        GroupOptions nine;
        nine.timeout = std::chrono::seconds(9);
        EXPECT_EQ(Group::from_process_group(world.process_group(), nine).timeout(),
                  milliseconds(9000));
        EXPECT_EQ(own.with_options(nine).timeout(), milliseconds(9000));
        EXPECT_EQ(Group::solo().timeout(), kDefaultTimeout);
        if (own.rank() == 1) std::this_thread::sleep_for(milliseconds(1200));
        at::Tensor t = at::ones({4});
        own.all_reduce_sum(t);
        EXPECT_TRUE(t.eq(2).all().item<bool>()) << t;
      },
      milliseconds(2500));
  EXPECT_EQ(errors, std::vector<std::string>(2, ""));
}

}  // namespace
}  // namespace ulysses
