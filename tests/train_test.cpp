// Sequence-parallel training pieces: the data adapter, the exact global loss and gradients of
// the model, against one rank holding the whole sequence.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "model.h"
#include "testing.h"
#include "ulysses/sharding.h"

namespace ulysses {
namespace {

using testing::expect_ranks_succeed;
using testing::rel_error;

TEST(ShardBatch, LabelsAreShiftedBeforeSharding) {
  // Targets must cross shard boundaries: the last token of shard r predicts the first token of
  // shard r + 1. Shifting inside each shard would drop that target.
  at::Tensor ids = at::arange(100, 110, at::kLong).unsqueeze(0);
  const auto seq = SequencePartition::even(10, 3);  // [4, 3, 3]
  for (int64_t r = 0; r < 3; ++r) {
    TokenBatch shard = shard_batch({ids, ids, at::Tensor()}, seq, r);
    const Range mine = seq.range(r);
    EXPECT_TRUE(shard.input_ids.equal(ids.narrow(1, mine.begin, mine.size())));
    EXPECT_TRUE(shard.position_ids.equal(at::arange(mine.begin, mine.end, at::kLong).unsqueeze(0)));
    for (int64_t i = 0; i < mine.size(); ++i) {
      const int64_t global = mine.begin + i;
      const int64_t want = global + 1 < 10 ? 100 + global + 1 : kIgnoreIndex;
      EXPECT_EQ(shard.labels[0][i].item<int64_t>(), want) << "rank " << r << " token " << i;
    }
  }
}

TEST(ShardBatch, IgnoredLabelsStayIgnored) {
  at::Tensor ids = at::arange(6, at::kLong).unsqueeze(0);
  at::Tensor labels = at::full({1, 6}, kIgnoreIndex, at::kLong);
  labels[0][3] = 42;
  TokenBatch shard = shard_batch({ids, labels, at::Tensor()}, SequencePartition::even(6, 2), 0);
  EXPECT_TRUE(shard.labels.equal(
      at::tensor(std::vector<int64_t>{kIgnoreIndex, kIgnoreIndex, 42}).unsqueeze(0)));
}

TEST(ShardBatch, PaddingNeitherPredictsNorIsPredicted) {
  // Row 0 left-padded by 2, row 1 right-padded by 1: a target is ignored where its input or
  // itself is padding; the mask is cut like the ids.
  at::Tensor ids = at::arange(12, at::kLong).view({2, 6});
  at::Tensor mask = at::ones({2, 6}, at::kLong);
  mask[0][0] = 0, mask[0][1] = 0, mask[1][5] = 0;
  const auto seq = SequencePartition::even(6, 2);
  std::vector<at::Tensor> targets, masks;
  for (int64_t r = 0; r < 2; ++r) {
    TokenBatch shard = shard_batch({ids, at::Tensor(), at::Tensor(), mask}, seq, r);
    targets.push_back(shard.labels);
    masks.push_back(shard.attention_mask);
  }
  const int64_t I = kIgnoreIndex;
  EXPECT_TRUE(
      at::cat(targets, 1)
          .equal(
              at::tensor(std::vector<int64_t>{I, I, 3, 4, 5, I, 7, 8, 9, 10, I, I}).view({2, 6})));
  EXPECT_TRUE(at::cat(masks, 1).equal(mask));
}

TEST(ShardBatch, RingLayoutTakesZigzagTokens) {
  // Ulysses 1 x ring 2 over 8 tokens: chunks of 2, ring rank 0 holds chunks 0 and 3.
  at::Tensor ids = at::arange(8, at::kLong).unsqueeze(0);
  TokenBatch shard = shard_batch({ids, at::Tensor(), at::Tensor()}, RingLayout::make(8, 1, 2), 0);
  EXPECT_TRUE(shard.input_ids.equal(at::tensor(std::vector<int64_t>{0, 1, 6, 7}).unsqueeze(0)));
  EXPECT_TRUE(shard.position_ids.equal(shard.input_ids));
  EXPECT_TRUE(
      shard.labels.equal(at::tensor(std::vector<int64_t>{1, 2, 7, kIgnoreIndex}).unsqueeze(0)));
}

// A parameter only some ranks have a gradient for (an expert no token of a shard chose) is
// summed as zeros where missing; one no rank used keeps none. Without the agreement the ranks'
// buckets would differ in size.
TEST(Gradients, SomeRanksLackAreSummedAsZeros) {
  expect_ranks_succeed(2, [](Group& g) {
    std::vector<at::Tensor> params;
    for (int i = 0; i < 3; ++i) params.push_back(at::zeros({4}).requires_grad_());
    params[0].mutable_grad() = at::full({4}, 1.0 + g.rank());
    if (g.rank() == 1) params[1].mutable_grad() = at::full({4}, 3.0);
    all_reduce_gradients(gradients_of(params, g), g);
    EXPECT_TRUE(params[0].grad().equal(at::full({4}, 3.0)));
    ASSERT_TRUE(params[1].grad().defined()) << "rank " << g.rank();
    EXPECT_TRUE(params[1].grad().equal(at::full({4}, 3.0)));
    EXPECT_FALSE(params[2].grad().defined());
  });
}

ModelConfig tiny() {
  ModelConfig c;
  c.vocab = 40;
  c.dim = 24;
  c.layers = 2;
  c.q_heads = 6;
  c.kv_heads = 3;
  return c;
}

// Loss and every gradient of P ranks equal one rank's on the same global batch (uneven S).
// `config`: the sharded model's (memory options included); the reference is tiny(), whole.
void check_against_single_rank(int P, int64_t S, const ModelConfig& config = tiny()) {
  expect_ranks_succeed(P, [&](Group& g) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::Tensor ids = at::randint(0, 40, {2, S}, gen, at::kLong);
    at::Tensor labels = ids.clone();
    labels.narrow(1, 0, 3).fill_(kIgnoreIndex);  // Some ignored targets.
    const TokenBatch global{ids, labels, at::Tensor()};
    const auto seq = SequencePartition::even(S, P);

    Transformer model(config, g, 11);
    TokenBatch shard = shard_batch(global, seq, g.rank());
    StepContext ctx(g);
    const int64_t longest = seq.range(0).size();  // even(): rank 0's shard is the largest.
    ShardedLoss loss = model->loss(shard, g, &ctx, longest);
    loss.loss.backward();
    all_reduce_gradients(gradients_of(model->parameters(), g), g);

    Group solo = Group::solo();
    Transformer reference(tiny(), solo, 11);
    TokenBatch whole = shard_batch(global, SequencePartition::even(S, 1), 0);
    ShardedLoss ref = sharded_cross_entropy(reference->forward(whole.input_ids, whole.position_ids),
                                            whole.labels, solo);
    ref.loss.backward();

    EXPECT_EQ(loss.global_count, ref.global_count);
    EXPECT_NEAR(loss.global_loss, ref.global_loss, 1e-5 * std::abs(ref.global_loss));
    auto ref_params = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      EXPECT_LT(rel_error(p.value().grad(), ref_params[p.key()].grad()), 1e-4)
          << p.key() << " rank " << g.rank() << " of " << P;
    }
  });
}

TEST(ShardedTraining, TwoRanksMatchOneRankUnevenS) { check_against_single_rank(2, 13); }
TEST(ShardedTraining, ThreeRanksMatchOneRankUnevenS) { check_against_single_rank(3, 14); }

// The long-sequence options: MLP tiles of 3 tokens (uneven), loss tiles of 2 rows, each block
// checkpointed; the same loss and gradients as the whole model on one rank.
ModelConfig long_sequence(Checkpoint checkpoint) {
  ModelConfig c = tiny();
  c.tiled = true;
  c.mlp_tile_tokens = 3;
  c.loss_tile_bytes = 2 * c.vocab * 4;
  c.checkpoint = checkpoint;
  return c;
}
TEST(ShardedTraining, OneRankTiledMatchesWhole) {
  check_against_single_rank(1, 13, long_sequence(Checkpoint::kNone));
}
TEST(ShardedTraining, TwoRanksTiledOffloadMatchOneRank) {
  check_against_single_rank(2, 13, long_sequence(Checkpoint::kOffload));
}
TEST(ShardedTraining, ThreeRanksTiledRecomputeMatchOneRank) {
  check_against_single_rank(3, 14, long_sequence(Checkpoint::kRecompute));
}

TEST(AllReduceGradients, BucketsSumEveryGradientOfEveryDtype) {
  // Buckets of 64 bytes: small gradients share one, a 160-byte one is summed in place, a
  // non-contiguous one goes through a bucket, and fp64 gradients fill their own buckets.
  const std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> shapes = {
      {{5, 3}, at::kFloat}, {{7}, at::kDouble}, {{2}, at::kFloat}, {{40}, at::kFloat},
      {{6, 4}, at::kFloat}, {{3}, at::kDouble}, {{1}, at::kFloat}};
  expect_ranks_succeed(3, [&](Group& g) {
    std::vector<at::Tensor> grads, want;
    for (size_t i = 0; i < shapes.size(); ++i) {
      at::Tensor base = testing::seeded_randn(shapes[i].first, 100 + i).to(shapes[i].second);
      at::Tensor mine = base * static_cast<double>(g.rank() + 1);
      if (i == 4) mine = mine.t().contiguous().t();  // same values, transposed strides
      grads.push_back(mine);
      want.push_back(base * 6.0);  // 1 + 2 + 3
    }
    ASSERT_FALSE(grads[4].is_contiguous());
    all_reduce_gradients(grads, g, 64);
    for (size_t i = 0; i < grads.size(); ++i) {
      EXPECT_LT(rel_error(grads[i], want[i]), 1e-6) << "gradient " << i << " rank " << g.rank();
    }
  });
}

TEST(ShardedLoss, OneRanksBadTargetFailsEveryRankAlike) {
  // Rank 1 alone has a target outside the vocabulary: both losses fail on every rank with the
  // same error, through the loss's one agreement round, instead of rank 0 waiting in it.
  for (const bool tiled : {false, true}) {
    const auto errors = testing::run_ranks(2, [&](Group& g) {
      at::Tensor targets = at::zeros({1, 3}, at::kLong);
      if (g.rank() == 1) targets[0][2] = 50;
      const at::Tensor hidden = testing::seeded_randn({1, 3, 4}, 1),
                       weight = testing::seeded_randn({7, 4}, 2);
      if (tiled) {
        sharded_linear_cross_entropy(hidden, weight, targets, g, 2);
      } else {
        sharded_cross_entropy(at::matmul(hidden, weight.t()), targets, g);
      }
    });
    testing::expect_ranks_fail_alike(errors, "targets must be in [0, 7)");
    EXPECT_NE(errors[0].find("rank 1"), std::string::npos) << errors[0];
  }
}

TEST(ShardedLoss, TokenMeanDividesBySumOfEveryRanksTargets) {
  expect_ranks_succeed(2, [&](Group& g) {
    at::Tensor targets = g.rank() == 0 ? at::tensor(std::vector<int64_t>{1, kIgnoreIndex, 2})
                                       : at::tensor(std::vector<int64_t>{kIgnoreIndex});
    at::Tensor sum = at::scalar_tensor(3.0 + g.rank(), at::kDouble).requires_grad_();
    ShardedLoss loss = token_mean(sum, targets.unsqueeze(0), g);
    EXPECT_EQ(loss.global_count, 2);
    EXPECT_DOUBLE_EQ(loss.global_loss, 3.5);
    loss.loss.backward();
    EXPECT_DOUBLE_EQ(sum.grad().item<double>(), 0.5);
  });
}

TEST(ShardedTraining, RotaryUsesGlobalPositions) {
  // A shard rotated with its global positions equals the same rows of the full rotation.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor x = at::randn({1, 10, 2, 8}, gen);
  at::Tensor pos = at::arange(10, at::kLong).unsqueeze(0);
  at::Tensor full = apply_rotary(x, pos, 10000);
  at::Tensor part = apply_rotary(x.narrow(1, 6, 4), pos.narrow(1, 6, 4), 10000);
  EXPECT_TRUE(part.allclose(full.narrow(1, 6, 4)));
  EXPECT_FALSE(part.allclose(apply_rotary(x.narrow(1, 6, 4), pos.narrow(1, 0, 4), 10000)));
}

}  // namespace
}  // namespace ulysses
