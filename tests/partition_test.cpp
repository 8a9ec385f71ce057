#include "ulysses/partition.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <sstream>

namespace ulysses {
namespace {

std::vector<int64_t> sizes(const std::vector<Range>& ranges) {
  std::vector<int64_t> out;
  for (const Range& r : ranges) out.push_back(r.size());
  return out;
}

using V = std::vector<int64_t>;
using Ranges = std::vector<Range>;

TEST(HeadPartition, GqaGroupsStayWhole) {
  auto p = HeadPartition::make(6, 3, 2);
  EXPECT_EQ(sizes(p.q_ranges()), (V{4, 2}));
  EXPECT_EQ(sizes(p.kv_ranges()), (V{2, 1}));
  EXPECT_EQ(p.q_ranges(), (Ranges{{0, 4}, {4, 6}}));
  EXPECT_EQ(p.kv_ranges(), (Ranges{{0, 2}, {2, 3}}));
  EXPECT_EQ(p.kv_map(0), (V{0, 0, 1, 1}));
  EXPECT_EQ(p.kv_map(1), (V{0, 0}));
  EXPECT_FALSE(p.replicates_kv());
}

TEST(HeadPartition, EvenMha) {
  auto p = HeadPartition::make(12, 12, 4);
  EXPECT_EQ(sizes(p.q_ranges()), (V{3, 3, 3, 3}));
  EXPECT_EQ(sizes(p.kv_ranges()), (V{3, 3, 3, 3}));
  EXPECT_EQ(p.kv_map(2), (V{0, 1, 2}));
}

TEST(HeadPartition, UnevenMha) {
  auto p = HeadPartition::make(7, 7, 4);
  EXPECT_EQ(sizes(p.q_ranges()), (V{2, 2, 2, 1}));
  EXPECT_EQ(p.q_ranges(), (Ranges{{0, 2}, {2, 4}, {4, 6}, {6, 7}}));
}

TEST(HeadPartition, MqaReplicatesKv) {
  auto p = HeadPartition::make(2, 1, 2);
  EXPECT_EQ(sizes(p.q_ranges()), (V{1, 1}));
  EXPECT_EQ(p.kv_ranges(), (Ranges{{0, 1}, {0, 1}}));
  EXPECT_EQ(p.kv_map(0), (V{0}));
  EXPECT_EQ(p.kv_map(1), (V{0}));
  EXPECT_TRUE(p.replicates_kv());
}

TEST(HeadPartition, GqaFewerKvThanRanks) {
  auto p = HeadPartition::make(8, 2, 4);
  EXPECT_EQ(sizes(p.q_ranges()), (V{2, 2, 2, 2}));
  EXPECT_EQ(p.kv_ranges(), (Ranges{{0, 1}, {0, 1}, {1, 2}, {1, 2}}));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p.kv_map(r), (V{0, 0}));
}

TEST(HeadPartition, GqaGroupStraddlesRanks) {
  // Groups of 3 query heads over uneven query blocks [2,2,1,1]: rank 1 needs kv heads 0 and 1.
  auto p = HeadPartition::make(6, 2, 4);
  EXPECT_EQ(sizes(p.q_ranges()), (V{2, 2, 1, 1}));
  EXPECT_EQ(p.kv_ranges(), (Ranges{{0, 1}, {0, 2}, {1, 2}, {1, 2}}));
  EXPECT_EQ(p.kv_map(1), (V{0, 1}));
  EXPECT_EQ(p.kv_map(2), (V{0}));
}

TEST(HeadPartition, SingleRankHoldsEverything) {
  auto p = HeadPartition::make(6, 2, 1);
  EXPECT_EQ(p.q_ranges(), (Ranges{{0, 6}}));
  EXPECT_EQ(p.kv_ranges(), (Ranges{{0, 2}}));
  EXPECT_EQ(p.kv_map(0), (V{0, 0, 0, 1, 1, 1}));
}

TEST(HeadPartition, EveryQueryHeadMapsToItsOwnKvHead) {
  // Exhaustive: the map is exact for every valid (Hq, Hkv, P) up to 16 heads.
  for (int64_t hkv = 1; hkv <= 16; ++hkv) {
    for (int64_t g = 1; hkv * g <= 16; ++g) {
      const int64_t hq = hkv * g;
      for (int64_t P = 1; P <= hq; ++P) {
        auto p = HeadPartition::make(hq, hkv, P);
        int64_t next_q = 0;
        for (int64_t r = 0; r < P; ++r) {
          const Range q = p.q_range(r), kv = p.kv_range(r);
          ASSERT_EQ(q.begin, next_q);
          ASSERT_GE(q.size(), 1) << p;
          next_q = q.end;
          auto map = p.kv_map(r);
          for (int64_t j = 0; j < q.size(); ++j) {
            ASSERT_EQ(kv.begin + map[j], (q.begin + j) / g) << p << " rank " << r;
            ASSERT_LT(map[j], kv.size());
          }
        }
        ASSERT_EQ(next_q, hq);
      }
    }
  }
}

TEST(HeadPartition, FewerQueryHeadsThanRanksIsAnError) {
  try {
    HeadPartition::make(1, 1, 2);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "query heads (1) must be >= sequence-parallel size (2); each rank needs at "
                  "least one query head; use an SP group of at most 1 rank"),
              std::string::npos)
        << e.what();
  }
}

TEST(HeadPartition, QueryHeadsMustBeAMultipleOfKvHeads) {
  EXPECT_THROW(HeadPartition::make(6, 4, 2), c10::ValueError);
  EXPECT_THROW(HeadPartition::make(0, 1, 1), c10::ValueError);
  EXPECT_THROW(HeadPartition::make(4, 4, 0), c10::ValueError);
}

TEST(HeadPartition, IsAValue) {
  auto a = HeadPartition::make(6, 3, 2), b = HeadPartition::make(6, 3, 2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, HeadPartition::make(6, 6, 2));
  std::ostringstream os;
  os << a;
  EXPECT_EQ(os.str(),
            "HeadPartition(q_heads=6, kv_heads=3, sp=2, q=[0, 4)[4, 6), kv=[0, 2)[2, 3))");
}

TEST(SequencePartition, UnevenSplit) {
  auto s = SequencePartition::even(10, 4);
  EXPECT_EQ(s.lengths(), (V{3, 3, 2, 2}));
  EXPECT_EQ(s.range(2), (Range{6, 8}));
  EXPECT_EQ(s.seq_len(), 10);
}

// Note [Head chunks]: kv groups whole, at least P query heads a chunk; "auto" the most chunks
// (up to 4) whose kv heads are each at least P.
TEST(HeadChunks, BlocksOfKvHeadsWithTheirQueryHeads) {
  const std::vector<HeadChunk> chunks = head_chunks(32, 8, 2, 4);
  ASSERT_EQ(chunks.size(), 4U);
  EXPECT_EQ(chunks[1].q, (Range{8, 16}));
  EXPECT_EQ(chunks[1].kv, (Range{2, 4}));
  EXPECT_THROW(head_chunks(8, 2, 2, 4), c10::ValueError);  // More chunks than kv heads.
  EXPECT_EQ(auto_head_chunks(32, 8, 2), 4);
  EXPECT_EQ(auto_head_chunks(32, 8, 4), 2);
  EXPECT_EQ(auto_head_chunks(32, 32, 2), 4);
  EXPECT_EQ(auto_head_chunks(8, 2, 4), 1);
  EXPECT_THROW(auto_head_chunks(8, 0, 2), c10::ValueError);
  // Recomputed: the most chunks the heads allow (each >= P query heads), up to 8.
  EXPECT_EQ(auto_head_chunks(32, 8, 2, true), 8);
  EXPECT_EQ(auto_head_chunks(32, 8, 4, true), 8);
  EXPECT_EQ(auto_head_chunks(32, 8, 8, true), 4);
  EXPECT_EQ(auto_head_chunks(8, 8, 4, true), 2);
  EXPECT_EQ(auto_head_chunks(4, 1, 2, true), 1);
  EXPECT_NO_THROW(head_chunks(32, 8, 4, auto_head_chunks(32, 8, 4, true)));
  EXPECT_THROW(head_chunks(32, 8, 8, auto_head_chunks(32, 8, 8, true) + 1), c10::ValueError);
}

TEST(SequencePartition, FewerTokensThanRanks) {
  EXPECT_EQ(SequencePartition::even(2, 3).lengths(), (V{1, 1, 0}));
}

TEST(SequencePartition, FromLengths) {
  auto s = SequencePartition::from_lengths({5, 1});
  EXPECT_EQ(s.range(1), (Range{5, 6}));
  EXPECT_THROW(SequencePartition::from_lengths({-1}), c10::ValueError);
}

TEST(Layout, DimsAndNames) {
  EXPECT_EQ(seq_dim(Layout::kBSHD), 1);
  EXPECT_EQ(head_dim(Layout::kBSHD), 2);
  EXPECT_EQ(seq_dim(Layout::kSBHD), 0);
  EXPECT_EQ(head_dim(Layout::kBHSD), 1);
  EXPECT_EQ(parse_layout("bhsd"), Layout::kBHSD);
  EXPECT_THROW(parse_layout("BSH"), c10::ValueError);
}

}  // namespace
}  // namespace ulysses
