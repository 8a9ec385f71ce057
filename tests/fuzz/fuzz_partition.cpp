// Fuzzes the head and sequence planners: any (Hq, Hkv, P) and any per-rank lengths either
// raise c10::ValueError or give partitions with every documented invariant.
#include <c10/util/Exception.h>

#include "fuzz_input.h"
#include "ulysses/partition.h"

using ulysses::HeadPartition;
using ulysses::SequencePartition;

namespace {

void check_heads(int64_t hq, int64_t hkv, int64_t P) {
  HeadPartition h = HeadPartition::make(hq, hkv, P);
  FUZZ_CHECK(hq >= P && hkv >= 1 && hq % hkv == 0);  // make accepted only valid counts
  FUZZ_CHECK(h.sp_size() == P && h.q_heads() == hq && h.kv_heads() == hkv);
  int64_t next = 0;
  for (int64_t r = 0; r < P; ++r) {
    const auto q = h.q_range(r), kv = h.kv_range(r);
    FUZZ_CHECK(q.begin == next && q.size() >= 1);  // contiguous, disjoint, non-empty
    // Balanced: by kv groups when every rank has a kv head of its own, else by query heads.
    if (hkv >= P) {
      FUZZ_CHECK(kv.size() >= hkv / P && kv.size() <= hkv / P + 1);
      FUZZ_CHECK(q.size() == kv.size() * h.group_size());
    } else {
      FUZZ_CHECK(q.size() >= hq / P && q.size() <= hq / P + 1);
    }
    next = q.end;
    FUZZ_CHECK(kv.begin >= 0 && kv.end <= hkv && kv.size() >= 1);
    const auto map = h.kv_map(r);
    FUZZ_CHECK(static_cast<int64_t>(map.size()) == q.size());
    for (int64_t i = 0; i < q.size(); ++i) {
      // Local query head i is global head q.begin + i; its kv head is (q.begin + i) / (Hq/Hkv).
      FUZZ_CHECK(map[i] >= 0 && map[i] < kv.size());
      FUZZ_CHECK(kv.begin + map[i] == (q.begin + i) / h.group_size());
    }
  }
  FUZZ_CHECK(next == hq);
  FUZZ_CHECK(h == HeadPartition::make(hq, hkv, P));  // a pure function of its arguments
}

void check_sequence(const std::vector<int64_t>& lengths, int64_t S) {
  const auto p = SequencePartition::from_lengths(lengths);
  int64_t total = 0;
  for (int64_t r = 0; r < p.sp_size(); ++r) {
    FUZZ_CHECK(p.range(r).begin == total && p.range(r).size() == lengths[r]);
    total += lengths[r];
  }
  FUZZ_CHECK(p.seq_len() == total);
  const auto even = SequencePartition::even(S, p.sp_size());
  FUZZ_CHECK(even.seq_len() == S);
  for (int64_t r = 0; r < even.sp_size(); ++r) {
    FUZZ_CHECK(even.length(r) == S / even.sp_size() + (r < S % even.sp_size()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ulysses::fuzz::Input in(data, size);
  const int64_t hq = in.in(-2, 300), hkv = in.in(-2, 300), P = in.in(-2, 70);
  try {
    check_heads(hq, hkv, P);
  } catch (const c10::ValueError&) {
    FUZZ_CHECK(!(hq >= P && P >= 1 && hkv >= 1 && hq % hkv == 0));  // rejected only invalid ones
  }
  std::vector<int64_t> lengths(in.in(1, 16));
  for (auto& n : lengths) n = in.in(-1, 1000);
  try {
    check_sequence(lengths, in.in(0, 100000));
  } catch (const c10::ValueError&) {
    bool negative = false;
    for (int64_t n : lengths) negative = negative || n < 0;
    FUZZ_CHECK(negative);
  }
  return 0;
}
