#include "ulysses/mask_decision.h"

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

namespace ulysses {
namespace {

std::string sizes_str(const std::array<int64_t, 4>& s) {
  std::ostringstream os;
  os << "[" << s[0] << ", " << s[1] << ", " << s[2] << ", " << s[3] << "]";
  return os.str();
}

}  // namespace

std::array<int64_t, 4> mask_sizes_4d(const std::vector<int64_t>& s, const std::string& name) {
  TORCH_CHECK_VALUE(s.size() >= 2 && s.size() <= 4, "rebuild_mask: ", name,
                    " must be 2-D [Sq, Sk], 3-D [heads, Sq, Sk] or 4-D [B, heads, Sq, Sk]; got "
                    "shape ",
                    c10::IntArrayRef(s));
  std::array<int64_t, 4> out{1, 1, 1, 1};
  std::copy(s.begin(), s.end(), out.begin() + (4 - s.size()));
  return out;
}

namespace {

// The per-rank rules of a mask (key dim, head dim, and batch when `batch` >= 0), raising with
// the shapes and the accepted forms. `sharded`, `full`, `broadcast` record the row forms seen.
struct MaskRules {
  const std::vector<std::array<int64_t, 4>>& sizes;
  int64_t q_heads;
  const SequencePartition& seq;
  const std::string& name;
  int64_t keys;

  std::string describe(int64_t r) const {
    std::ostringstream os;
    os << name << " has shape " << sizes_str(sizes[r]) << " on rank " << r << " of "
       << seq.sp_size() << " (S=" << seq.seq_len() << ", S_r=" << seq.length(r)
       << ", Hq=" << q_heads << ")";
    return os.str();
  }

  void check_rank(int64_t r, int64_t batch) const {
    const std::string accepted =
        "accepted: [B or 1, 1 or Hq, S_r or S or 1, S or 1] (2-D [Sq, Sk], 3-D [heads, Sq, Sk])";
    const auto& s = sizes[r];
    const int64_t S = seq.seq_len();
    TORCH_CHECK_VALUE(s[0] == sizes[0][0] && s[1] == sizes[0][1] && s[3] == sizes[0][3],
                      "rebuild_mask: ranks disagree on ", name, "'s shape: ", describe(0), " but ",
                      describe(r));
    TORCH_CHECK_VALUE(batch < 0 || s[0] == 1 || s[0] == batch, "rebuild_mask: ", describe(r),
                      ": batch dim must be 1 or B (", batch, "); ", accepted);
    TORCH_CHECK_VALUE(!(s[3] == seq.length(r) && s[3] != keys && s[3] != 1),
                      "rebuild_mask: ", describe(r),
                      ": its key dim is sharded, and a key-sharded mask cannot be rebuilt from "
                      "local pieces; pass a mask over all S keys");
    TORCH_CHECK_VALUE(s[3] == keys || s[3] == 1, "rebuild_mask: ", describe(r),
                      ": key dim must be ", keys == S ? "S" : std::to_string(keys) + " (all keys)",
                      " or 1; ", accepted);
    TORCH_CHECK_VALUE(s[1] == 1 || s[1] == q_heads, "rebuild_mask: ", describe(r),
                      ": head dim must be 1 or Hq; ", accepted);
  }

  // Checks every rank and returns the decision (any P; at P == 1 rows are full or broadcast).
  MaskDecision decide(int64_t batch) const {
    const int64_t P = seq.sp_size(), S = seq.seq_len();
    bool sharded = true, full = true, broadcast = true;
    for (int64_t r = 0; r < P; ++r) {
      check_rank(r, batch);
      sharded = sharded && sizes[r][2] == seq.length(r);
      full = full && sizes[r][2] == S;
      broadcast = broadcast && sizes[r][2] == 1;
    }
    TORCH_CHECK_VALUE(sharded || full || broadcast, "rebuild_mask: ", name,
                      "'s query dim must be S_r on every rank, S, or 1; ", describe(0),
                      "; accepted: [B or 1, 1 or Hq, S_r or S or 1, S or 1]");
    MaskDecision d;
    d.rows = sharded ? MaskRows::kSharded : full ? MaskRows::kFull : MaskRows::kBroadcast;
    d.heads = sizes[0][1] == 1 ? MaskHeads::kShared : MaskHeads::kPerHead;
    return d;
  }
};

}  // namespace

MaskDecision decide_mask(const std::vector<std::array<int64_t, 4>>& sizes, int64_t q_heads,
                         const SequencePartition& seq, const std::string& name, int64_t key_len) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(sizes.size()) == seq.sp_size() && seq.sp_size() > 1);
  return MaskRules{sizes, q_heads, seq, name, key_len < 0 ? seq.seq_len() : key_len}.decide(-1);
}

void check_mask_shapes(const std::vector<std::array<int64_t, 4>>& sizes, int64_t batch,
                       int64_t q_heads, const SequencePartition& seq, const std::string& name,
                       int64_t key_len) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(sizes.size()) == seq.sp_size());
  MaskRules{sizes, q_heads, seq, name, key_len < 0 ? seq.seq_len() : key_len}.decide(batch);
}

bool mask_shared_across_heads(const std::vector<int64_t>& sizes) {
  return sizes.size() < 3 || sizes[sizes.size() - 3] == 1;
}

std::vector<int64_t> rebuilt_mask_shape(const std::vector<int64_t>& sizes,
                                        const HeadPartition& heads, const SequencePartition& seq,
                                        int64_t rank, int64_t key_len) {
  auto s = mask_sizes_4d(sizes, "mask");
  if (seq.sp_size() == 1) return {s[0], s[1], s[2], s[3]};
  std::vector<std::array<int64_t, 4>> all;
  // A rank holding one token cannot tell one sharded row from a broadcast row: it reads it as
  // broadcast (the common key-padding form), unless every rank holds one token (then the two
  // are the same thing and decide_mask calls it sharded).
  bool all_one = true;
  for (int64_t n : seq.lengths()) all_one = all_one && n == 1;
  const bool sharded = s[2] == seq.length(rank) && (s[2] != 1 || all_one);
  for (int64_t r = 0; r < seq.sp_size(); ++r) {
    auto t = s;
    if (sharded) t[2] = seq.length(r);  // Sharded rows on every rank.
    all.push_back(t);
  }
  const MaskDecision d = decide_mask(all, heads.q_heads(), seq, "mask", key_len);
  const int64_t rows = d.rows == MaskRows::kSharded ? seq.seq_len() : s[2];
  const int64_t h = d.heads == MaskHeads::kShared ? 1 : heads.q_range(rank).size();
  return {s[0], h, rows, s[3]};
}

}  // namespace ulysses
