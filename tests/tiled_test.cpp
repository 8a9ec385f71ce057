// Tiled compute and checkpoints (tiled.h) against the same computation done whole by autograd:
// values and every gradient, uneven and empty tiles, ignored targets, the recompute's RNG replay,
// host copies released after a failed backward.
#include "ulysses/tiled.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/torch.h>

#include "testing.h"
#include "training/offloaded_bytes.h"

namespace ulysses {
namespace {

using testing::rel_error;

at::Generator seeded(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

at::Tensor leaf(at::IntArrayRef sizes, at::Generator& gen, double scale = 1.0) {
  return (at::randn(sizes, gen) * scale).requires_grad_(true);
}

// Gradients of `out` (summed against a fixed random weight) with respect to `wrt`.
std::vector<at::Tensor> gradients(const at::Tensor& out, const std::vector<at::Tensor>& wrt) {
  auto gen = seeded(99);
  const at::Tensor probe = at::randn(out.sizes(), gen);
  return torch::autograd::grad({(out * probe).sum()}, wrt);
}

TEST(TileCount, CoversTheRows) {
  EXPECT_EQ(tile_count(0, 4), 1);
  EXPECT_EQ(tile_count(8, 4), 2);
  EXPECT_EQ(tile_count(9, 4), 3);
  EXPECT_THROW(tile_count(3, 0), c10::ValueError);
}

class LinearCrossEntropy : public ::testing::TestWithParam<int64_t> {};

TEST_P(LinearCrossEntropy, EqualsCrossEntropyOfTheLogits) {
  const int64_t tiles = GetParam();
  const int64_t N = 37, E = 16, V = 50;
  auto gen = seeded(3);
  at::Tensor h = leaf({N, E}, gen), w = leaf({V, E}, gen, 0.3);
  at::Tensor y = at::randint(0, V, {N}, gen, at::kLong);
  y.narrow(0, 0, 10).fill_(-100);  // The first tile of 4 has no valid target at all.
  y[20] = -100;
  const at::Tensor ours = linear_cross_entropy_sum(h, w, y, tiles);
  const at::Tensor ref =
      at::cross_entropy_loss(at::matmul(h, w.t()), y, {}, at::Reduction::Sum, -100);
  EXPECT_LT(rel_error(ours, ref), 1e-6) << "tiles " << tiles;
  const auto g = torch::autograd::grad({ours * 1.5}, {h, w});
  const auto r = torch::autograd::grad({ref * 1.5}, {h, w});
  EXPECT_LT(rel_error(g[0], r[0]), 1e-6) << "hidden, tiles " << tiles;
  EXPECT_LT(rel_error(g[1], r[1]), 1e-6) << "weight, tiles " << tiles;
  EXPECT_TRUE(g[0].narrow(0, 0, 10).eq(0).all().item<bool>()) << "ignored rows take no gradient";
  // The ignored rows matter: scoring them changes the sum.
  const at::Tensor all =
      at::cross_entropy_loss(at::matmul(h, w.t()), y.clamp_min(0), {}, at::Reduction::Sum, -100);
  EXPECT_GT(rel_error(all, ref), 1e-3);
}

// 1 tile, uneven tiles, one row per tile, more tiles than rows.
INSTANTIATE_TEST_SUITE_P(Tiles, LinearCrossEntropy, ::testing::Values(1, 4, 37, 40));

TEST(LinearCrossEntropyErrors, AllIgnoredGivesZeroAndZeroGradients) {
  auto gen = seeded(4);
  at::Tensor h = leaf({6, 4}, gen), w = leaf({9, 4}, gen);
  const at::Tensor loss = linear_cross_entropy_sum(h, w, at::full({6}, -100, at::kLong), 2);
  EXPECT_EQ(loss.item<float>(), 0.0f);
  const auto g = torch::autograd::grad({loss}, {h, w});
  EXPECT_TRUE(g[0].eq(0).all().item<bool>() && g[1].eq(0).all().item<bool>());
}

TEST(LinearCrossEntropyErrors, BadTargetsAreNamed) {
  auto gen = seeded(5);
  at::Tensor h = leaf({3, 4}, gen), w = leaf({9, 4}, gen);
  EXPECT_THROW(
      {
        try {
          linear_cross_entropy_sum(h, w, at::tensor({0, 9, 1}, at::kLong), 1);
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("targets must be in [0, 9)"), std::string::npos);
          throw;
        }
      },
      c10::ValueError);
}

// A SwiGLU MLP with its own parameters, position-wise over [B, S, E].
struct Mlp {
  at::Tensor w1, w2, w3;
  explicit Mlp(at::Generator& gen)
      : w1(leaf({20, 8}, gen)), w2(leaf({8, 20}, gen)), w3(leaf({20, 8}, gen)) {}
  at::Tensor operator()(const at::Tensor& x) const {
    return at::matmul(at::silu(at::matmul(x, w1.t())) * at::matmul(x, w3.t()), w2.t());
  }
  std::vector<at::Tensor> params() const { return {w1, w2, w3}; }
};

class TiledMap : public ::testing::TestWithParam<int64_t> {};

TEST_P(TiledMap, EqualsTheWholeMlpWithOneGradientPerParameter) {
  const int64_t tiles = GetParam();
  auto gen = seeded(6);
  const Mlp mlp(gen);
  at::Tensor x = leaf({2, 13, 8}, gen);
  // Counts what a DDP reducer sees: its hooks run after each parameter's AccumulateGrad.
  // A reducer holds the accumulators too: a parameter keeps only a weak pointer to its own.
  int hooks = 0;
  std::vector<decltype(torch::autograd::Edge::function)> accumulators;  // Per torch version.
  for (const at::Tensor& p : mlp.params()) {
    accumulators.push_back(torch::autograd::impl::grad_accumulator(p));
    accumulators.back()->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [&hooks](const torch::autograd::variable_list& outputs,
                 const torch::autograd::variable_list&) {
          ++hooks;
          return outputs;
        }));
  }
  const at::Tensor ours = tiled_map(mlp, x, tiles, mlp.params());
  EXPECT_EQ(hooks, 0);
  std::vector<at::Tensor> wrt = mlp.params();
  wrt.insert(wrt.begin(), x);
  const auto g = gradients(ours, wrt);
  EXPECT_EQ(hooks, 0) << "autograd::grad accumulates nothing";
  const at::Tensor ref = mlp(x);
  EXPECT_LT(rel_error(ours, ref), 1e-6) << "tiles " << tiles;
  const auto r = gradients(ref, wrt);
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_LT(rel_error(g[i], r[i]), 1e-6) << "input " << i << ", tiles " << tiles;
  }
  // Through .backward(): each parameter's gradient arrives once, as a reducer's hook needs.
  hooks = 0;
  (tiled_map(mlp, x, tiles, mlp.params()) * 2).sum().backward();
  EXPECT_EQ(hooks, 3) << "tiles " << tiles;
}

// 1 tile, uneven tiles (13 rows in 3), one row per tile, empty tiles (20 > 13).
INSTANTIATE_TEST_SUITE_P(Tiles, TiledMap, ::testing::Values(1, 3, 13, 20));

TEST(TiledMap, WithoutGradientsRunsTheTilesOnly) {
  auto gen = seeded(7);
  const Mlp mlp(gen);
  at::Tensor x = at::randn({1, 9, 8}, gen);
  at::NoGradGuard no_grad;
  const at::Tensor y = tiled_map(mlp, x, 4, mlp.params());
  EXPECT_FALSE(y.requires_grad());
  EXPECT_LT(rel_error(y, mlp(x)), 1e-6);
}

class CheckpointModes : public ::testing::TestWithParam<Checkpoint> {};

TEST_P(CheckpointModes, SameGradientsWithDropoutReplayed) {
  auto gen = seeded(8);
  const Mlp mlp(gen);
  at::Tensor x = leaf({2, 11, 8}, gen);
  // Dropout draws from the default CPU generator: the recompute must draw the same mask.
  auto layer = [&mlp](const at::Tensor& t) { return at::dropout(mlp(t), 0.3, true); };
  std::vector<at::Tensor> wrt = mlp.params();
  wrt.insert(wrt.begin(), x);

  at::manual_seed(123);
  const at::Tensor ref = layer(x) * 3;
  const auto r = gradients(ref, wrt);
  at::manual_seed(123);
  const int64_t before = offloaded_bytes();
  const at::Tensor ours = checkpoint(layer, x, mlp.params(), GetParam()) * 3;
  const int64_t held = offloaded_bytes() - before;
  EXPECT_EQ(held, GetParam() == Checkpoint::kOffload ? x.nbytes() : 0);
  EXPECT_TRUE(ours.equal(ref));
  const auto g = gradients(ours, wrt);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(g[i].equal(r[i])) << "input " << i;
}

INSTANTIATE_TEST_SUITE_P(Modes, CheckpointModes,
                         ::testing::Values(Checkpoint::kNone, Checkpoint::kRecompute,
                                           Checkpoint::kOffload),
                         [](const auto& info) {
                           return std::string(info.param == Checkpoint::kNone        ? "None"
                                              : info.param == Checkpoint::kRecompute ? "Recompute"
                                                                                     : "Offload");
                         });

TEST(Checkpoint, HostCopiesLiveWithTheGraphOnly) {
  auto gen = seeded(9);
  const Mlp mlp(gen);
  at::Tensor x = leaf({1, 7, 8}, gen);
  const int64_t before = offloaded_bytes();
  {
    at::Tensor h = checkpoint(mlp, x, mlp.params(), Checkpoint::kOffload);
    h = checkpoint(mlp, h, mlp.params(), Checkpoint::kOffload);
    EXPECT_EQ(offloaded_bytes() - before, 2 * x.nbytes());
    h.sum().backward();
    EXPECT_TRUE(x.grad().defined());
  }
  EXPECT_EQ(offloaded_bytes(), before);
}

TEST(Checkpoint, FailureMidBackwardLeavesNoHostCopy) {
  auto gen = seeded(10);
  const Mlp mlp(gen);
  at::Tensor x = leaf({1, 7, 8}, gen);
  const int64_t before = offloaded_bytes();
  int calls = 0;
  auto failing = [&](const at::Tensor& t) {
    TORCH_CHECK(++calls < 2, "layer failed in its recompute");
    return mlp(t);
  };
  {
    at::Tensor h = checkpoint(mlp, x, mlp.params(), Checkpoint::kOffload);
    h = checkpoint(failing, h, mlp.params(), Checkpoint::kOffload);
    EXPECT_EQ(offloaded_bytes() - before, 2 * x.nbytes());
    EXPECT_THROW(
        {
          try {
            h.sum().backward();
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what()).find("failed in its recompute"), std::string::npos);
            throw;
          }
        },
        c10::Error);
  }
  EXPECT_EQ(offloaded_bytes(), before) << "the graph is gone, so are its host copies";
}

}  // namespace
}  // namespace ulysses
