// The pure mask decision: decide_mask and rebuilt_mask_shape (no tensors, no process groups).
#include "ulysses/mask_decision.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace ulysses {
namespace {

using Sizes = std::vector<std::array<int64_t, 4>>;

TEST(DecideMask, SharedQueryShardedRows) {
  auto seq = SequencePartition::even(10, 3);  // [4, 3, 3]
  auto d = decide_mask(Sizes{{2, 1, 4, 10}, {2, 1, 3, 10}, {2, 1, 3, 10}}, 6, seq);
  EXPECT_EQ(d, (MaskDecision{MaskRows::kSharded, MaskHeads::kShared}));
}

TEST(DecideMask, PerHeadFullAndBroadcast) {
  auto seq = SequencePartition::even(8, 2);
  EXPECT_EQ(decide_mask(Sizes{{1, 6, 8, 8}, {1, 6, 8, 8}}, 6, seq),
            (MaskDecision{MaskRows::kFull, MaskHeads::kPerHead}));
  EXPECT_EQ(decide_mask(Sizes{{1, 1, 1, 8}, {1, 1, 1, 8}}, 6, seq),
            (MaskDecision{MaskRows::kBroadcast, MaskHeads::kShared}));
  EXPECT_EQ(decide_mask(Sizes{{1, 1, 4, 1}, {1, 1, 4, 1}}, 6, seq),
            (MaskDecision{MaskRows::kSharded, MaskHeads::kShared}));
}

TEST(DecideMask, OneTokenPerRankIsSharded) {
  auto seq = SequencePartition::even(2, 2);
  EXPECT_EQ(decide_mask(Sizes{{1, 1, 1, 2}, {1, 1, 1, 2}}, 2, seq).rows, MaskRows::kSharded);
}

TEST(DecideMask, KeyShardedIsAClearError) {
  auto seq = SequencePartition::even(8, 2);
  try {
    decide_mask(Sizes{{1, 1, 4, 4}, {1, 1, 4, 4}}, 4, seq, "attention_mask");
    FAIL();
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("attention_mask has shape [1, 1, 4, 4] on rank 0 of 2 "
                                         "(S=8, S_r=4, Hq=4): its key dim is sharded"),
              std::string::npos)
        << e.what();
  }
}

TEST(DecideMask, OtherShapesAreErrors) {
  auto seq = SequencePartition::even(8, 2);
  EXPECT_THROW(decide_mask(Sizes{{1, 3, 4, 8}, {1, 3, 4, 8}}, 4, seq), c10::ValueError);
  EXPECT_THROW(decide_mask(Sizes{{1, 1, 5, 8}, {1, 1, 5, 8}}, 4, seq), c10::ValueError);
  EXPECT_THROW(decide_mask(Sizes{{1, 1, 4, 7}, {1, 1, 4, 7}}, 4, seq), c10::ValueError);
  EXPECT_THROW(decide_mask(Sizes{{1, 1, 4, 8}, {1, 1, 8, 8}}, 4, seq), c10::ValueError);
}

TEST(RebuiltMaskShape, FollowsTheDecisionOnEveryRank) {
  const auto seq = SequencePartition::even(7, 2);  // [4, 3]
  const auto heads = HeadPartition::make(6, 2, 2);
  EXPECT_EQ(rebuilt_mask_shape({2, 1, 3, 7}, heads, seq, 1), (std::vector<int64_t>{2, 1, 7, 7}));
  EXPECT_EQ(rebuilt_mask_shape({6, 7, 7}, heads, seq, 0), (std::vector<int64_t>{1, 3, 7, 7}));
  EXPECT_EQ(rebuilt_mask_shape({4, 7}, heads, seq, 0), (std::vector<int64_t>{1, 1, 7, 7}));
  EXPECT_EQ(rebuilt_mask_shape({1, 1, 1, 7}, heads, seq, 0), (std::vector<int64_t>{1, 1, 1, 7}));
}

TEST(RebuiltMaskShape, OneRowOnARankWithOneTokenIsBroadcast) {
  // Rank 1 holds one token: its one row could be its shard or a broadcast row; it is read as
  // broadcast, which is what the other ranks (with more tokens) must then hold too.
  const auto seq = SequencePartition::from_lengths({4, 1});
  const auto heads = HeadPartition::make(2, 1, 2);
  EXPECT_EQ(rebuilt_mask_shape({1, 1, 1, 5}, heads, seq, 1), (std::vector<int64_t>{1, 1, 1, 5}));
  EXPECT_EQ(rebuilt_mask_shape({1, 1, 1, 5}, heads, seq, 0), (std::vector<int64_t>{1, 1, 1, 5}));
  // Every rank one token: sharded and broadcast coincide; decide_mask calls it sharded.
  const auto ones = SequencePartition::from_lengths({1, 1});
  EXPECT_EQ(rebuilt_mask_shape({1, 1, 1, 2}, heads, ones, 1), (std::vector<int64_t>{1, 1, 2, 2}));
}

TEST(MaskSizes4d, PadsLeadingDimsAndRejectsOthers) {
  EXPECT_EQ(mask_sizes_4d({3, 5}, "m"), (std::array<int64_t, 4>{1, 1, 3, 5}));
  EXPECT_EQ(mask_sizes_4d({2, 3, 5}, "m"), (std::array<int64_t, 4>{1, 2, 3, 5}));
  EXPECT_THROW(mask_sizes_4d({5}, "m"), c10::ValueError);
  EXPECT_THROW(mask_sizes_4d({1, 1, 1, 1, 5}, "m"), c10::ValueError);
}

}  // namespace
}  // namespace ulysses
