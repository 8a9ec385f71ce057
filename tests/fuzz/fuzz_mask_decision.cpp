// Fuzzes the mask decision (decide_mask) and the shape a compiler is promised
// (rebuilt_mask_shape): any per-rank mask sizes either raise c10::ValueError or give the branch
// the rules in ulysses/mask.h name, and the promised shape agrees with it.
#include <c10/util/Exception.h>

#include "fuzz_input.h"
#include "ulysses/mask.h"

using namespace ulysses;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const int64_t P = in.in(2, 6);
  std::vector<int64_t> lengths(P);
  for (auto& n : lengths) n = in.in(0, 9);
  const auto seq = SequencePartition::from_lengths(lengths);
  const int64_t S = seq.seq_len(), hq = in.in(P, 12);
  // Each dim is picked among the values the rules care about, or any small number.
  auto pick = [&](int64_t rank, int64_t which) -> int64_t {
    switch (in.in(0, 5)) {
      case 0:
        return 1;
      case 1:
        return S;
      case 2:
        return seq.length(rank);
      case 3:
        return which == 1 ? hq : in.in(1, 3);
      default:
        return in.in(0, 13);
    }
  };
  const bool same_everywhere = in.in(0, 1) == 1;
  std::vector<std::array<int64_t, 4>> sizes(P);
  for (int64_t r = 0; r < P; ++r) {
    for (int64_t d = 0; d < 4; ++d)
      sizes[r][d] = same_everywhere && r > 0 ? sizes[0][d] : pick(r, d);
  }
  try {
    const MaskDecision d = decide_mask(sizes, hq, seq);
    for (int64_t r = 0; r < P; ++r) {
      const auto& s = sizes[r];
      FUZZ_CHECK(s[0] == sizes[0][0] && s[1] == sizes[0][1] && s[3] == sizes[0][3]);
      FUZZ_CHECK(s[3] == S || s[3] == 1);
      FUZZ_CHECK(s[1] == 1 || s[1] == hq);
      if (d.rows == MaskRows::kSharded) FUZZ_CHECK(s[2] == seq.length(r));
      if (d.rows == MaskRows::kFull) FUZZ_CHECK(s[2] == S);
      if (d.rows == MaskRows::kBroadcast) FUZZ_CHECK(s[2] == 1);
    }
    FUZZ_CHECK((d.heads == MaskHeads::kShared) == (sizes[0][1] == 1));
    // The shape promised before any collective matches the decision on every rank.
    // (Unless the mask's holding is ambiguous from one rank: one row on a rank with one token is
    // sharded or broadcast, depending on the other ranks; it is documented to read as broadcast.)
    const auto heads = HeadPartition::make(hq, 1, P);
    bool all_one = true;
    for (int64_t n : lengths) all_one = all_one && n == 1;
    for (int64_t r = 0; r < P; ++r) {
      if (sizes[r][2] == 1 && seq.length(r) == 1 && !all_one && d.rows == MaskRows::kSharded)
        continue;
      const auto& s = sizes[r];
      const auto shape = rebuilt_mask_shape({s[0], s[1], s[2], s[3]}, heads, seq, r);
      FUZZ_CHECK(shape.size() == 4 && shape[0] == s[0] && shape[3] == s[3]);
      FUZZ_CHECK(shape[1] == (s[1] == 1 ? 1 : heads.q_range(r).size()));
      FUZZ_CHECK(shape[2] == (d.rows == MaskRows::kBroadcast ? 1 : S));
    }
  } catch (const c10::ValueError&) {
    // Rejected: fine, as long as it is this error type (anything else escapes and crashes).
  }
  return 0;
}
