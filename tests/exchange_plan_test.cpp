// The exchange plan alone: no tensors, no process groups.
#include "ulysses/exchange_plan.h"

#include <gtest/gtest.h>

#include <sstream>

namespace ulysses {
namespace {

struct Case {
  int64_t hq, hkv;
  std::vector<int64_t> lengths;
};

const Case kCases[] = {
    {8, 2, {3, 3, 2, 2}},  // GQA, Hkv < P: kv heads replicated
    {15, 15, {5, 4}},      // uneven heads
    {6, 3, {4, 0, 3}},     // an empty shard
    {4, 1, {1, 1, 1, 1}},  // MQA
    {12, 4, {7}},          // one rank
};

std::vector<ExchangePlan> plans_of(const Case& s, const std::vector<Heads>& kinds,
                                   const std::vector<int64_t>& elements) {
  const auto seq = SequencePartition::from_lengths(s.lengths);
  const auto heads = HeadPartition::make(s.hq, s.hkv, seq.sp_size());
  std::vector<ExchangePlan> plans;
  for (int64_t r = 0; r < seq.sp_size(); ++r) {
    plans.push_back(ExchangePlan::seq_to_heads(heads, seq, r, kinds, elements));
  }
  return plans;
}

TEST(ExchangePlan, WhatARankSendsIsWhatItsPeerReceives) {
  for (const Case& s : kCases) {
    for (const auto& plans :
         {plans_of(s, {Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue}, {16, 16, 8}),
          plans_of(s, {Heads::kQuery}, {3})}) {
      const auto P = static_cast<int64_t>(plans.size());
      for (int64_t r = 0; r < P; ++r) {
        for (int64_t j = 0; j < P; ++j) {
          EXPECT_EQ(plans[r].send_splits()[j], plans[j].recv_splits()[r]);
          EXPECT_EQ(plans[r].reversed().send_splits()[j], plans[j].reversed().recv_splits()[r]);
        }
      }
    }
  }
}

// total_elements is what all ranks send together, and every rank's plan (either direction)
// holds the same value: ranks choose how to run an exchange from it.
TEST(ExchangePlan, TotalElementsIsWhatAllRanksSend) {
  for (const Case& s : kCases) {
    const auto plans = plans_of(s, {Heads::kQuery, Heads::kKeyValue}, {16, 8});
    int64_t sent = 0;
    for (const ExchangePlan& p : plans)
      for (int64_t n : p.send_splits()) sent += n;
    for (const ExchangePlan& p : plans) {
      EXPECT_EQ(p.total_elements(), sent);
      EXPECT_EQ(p.reversed().total_elements(), sent);
    }
  }
}

TEST(ExchangePlan, BlocksTileTheBuffersInOrder) {
  for (const Case& s : kCases) {
    for (const ExchangePlan& p : plans_of(s, {Heads::kQuery, Heads::kKeyValue}, {2, 2})) {
      for (const auto* blocks : {&p.send(), &p.recv()}) {
        int64_t offset = 0;
        for (const ExchangeBlock& b : *blocks) {
          EXPECT_EQ(b.offset, offset);
          EXPECT_EQ(b.numel, b.tokens.size() * b.heads.size() * 2);
          offset += b.numel;
        }
      }
    }
  }
}

TEST(ExchangePlan, ReversedSwapsDirectionsAndSumsOnlyReplicatedHeads) {
  for (const Case& s : kCases) {
    const auto plans = plans_of(s, {Heads::kQuery, Heads::kKeyValue}, {4, 4});
    const bool replicated = s.hkv < static_cast<int64_t>(s.lengths.size());
    for (const ExchangePlan& p : plans) {
      const ExchangePlan back = p.reversed();
      EXPECT_EQ(back.reversed(), p);
      EXPECT_EQ(back.send(), p.recv());
      EXPECT_EQ(back.outputs(), p.inputs());
      EXPECT_FALSE(p.sums_received());
      EXPECT_EQ(back.sums_received(), replicated) << back;
    }
  }
}

TEST(ExchangePlan, SequenceToHeadsExtentsAndPrinting) {
  const auto seq = SequencePartition::from_lengths({3, 2});
  const auto heads = HeadPartition::make(6, 3, 2);  // q [0,4)[4,6), kv [0,2)[2,3)
  const auto p =
      ExchangePlan::seq_to_heads(heads, seq, 1, {Heads::kQuery, Heads::kKeyValue}, {1, 1});
  EXPECT_EQ(p.inputs(), (std::vector<Extent>{{2, 6}, {2, 3}}));
  EXPECT_EQ(p.outputs(), (std::vector<Extent>{{5, 2}, {5, 1}}));
  EXPECT_EQ(p.send_splits(), (std::vector<int64_t>{2 * 4 + 2 * 2, 2 * 2 + 2 * 1}));
  EXPECT_EQ(p.recv_splits(), (std::vector<int64_t>{3 * 2 + 3 * 1, 2 * 2 + 2 * 1}));
  std::ostringstream os;
  os << p;
  EXPECT_EQ(os.str().rfind("ExchangePlan(send=[peer 0 t0 tokens[0, 2) heads[0, 4) @0+8", 0), 0u)
      << os.str();
  EXPECT_NE(p, p.reversed());
  EXPECT_THROW(ExchangePlan::seq_to_heads(heads, seq, 2, {Heads::kQuery}, {1}), c10::ValueError);
}

}  // namespace
}  // namespace ulysses
