// The plan of one Ulysses all-to-all on one rank: which block of each local tensor goes to
// each peer, and where each peer's block lands. Pure values (no tensors, no collectives),
// computed identically from (HeadPartition, SequencePartition, rank); the tensor code in
// all_to_all.cpp only executes plans.
//
// Sequence -> heads on rank r (scatter_heads), for each fused tensor t with head ranges R_t:
//   to peer j:   local tokens [0, S_r) x heads R_t[j]
//   from peer j: output tokens range(j) x local heads [0, |R_t[r]|)
// Heads -> sequence (gather_heads) is the same exchange reversed(): sends and receives swap, and
// blocks that land on the same heads (kv heads replicated over ranks, Hkv < P) are summed. As
// c10d's AllToAllSingle swaps its split sizes for backward, the backward of each direction is
// the other: one computation, two directions.
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "ulysses/partition.h"

namespace ulysses {

// Which heads of a HeadPartition a tensor carries.
enum class Heads {
  kQuery,     // Hq heads: Q, O, query-head masks.
  kKeyValue,  // Hkv heads: K, V.
};
// "query" or "kv": a kind of heads as messages name it ("8 query heads").
inline const char* heads_word(Heads h) { return h == Heads::kQuery ? "query" : "kv"; }

// One block of one tensor, exchanged with one peer.
struct ExchangeBlock {
  int64_t peer = 0;    // The rank it goes to or comes from.
  int64_t tensor = 0;  // Which of the fused tensors.
  Range tokens;        // Along the local tensor's sequence dim.
  Range heads;         // Along the local tensor's head dim.
  int64_t offset = 0;  // Elements before it in the flat send (or receive) buffer.
  int64_t numel = 0;   // tokens x heads x the tensor's elements per (token, head).
  bool operator==(const ExchangeBlock& o) const;
};

// Token and head extents of one local tensor (its other dims are unchanged by the exchange).
struct Extent {
  int64_t tokens = 0;
  int64_t heads = 0;
  bool operator==(const Extent& o) const { return tokens == o.tokens && heads == o.heads; }
};

class ExchangePlan {
 public:
  // The sequence -> heads exchange on `rank` for tensors of the given head tensor_heads, each with
  // `elements[t]` elements per (token, head) (e.g. B x D). Precondition: heads and seq are for
  // the same number of ranks, rank in [0, P).
  static ExchangePlan seq_to_heads(const HeadPartition& heads, const SequencePartition& seq,
                                   int64_t rank, const std::vector<Heads>& tensor_heads,
                                   const std::vector<int64_t>& elements);
  // The inverse direction (the backward): sends and receives swapped.
  ExchangePlan reversed() const;

  // Elements sent to / received from each peer, in rank order (the collective's splits).
  const std::vector<int64_t>& send_splits() const { return send_splits_; }
  const std::vector<int64_t>& recv_splits() const { return recv_splits_; }
  // Blocks in buffer order (by peer, then tensor).
  const std::vector<ExchangeBlock>& send() const { return send_; }
  const std::vector<ExchangeBlock>& recv() const { return recv_; }
  // Extents of each input and output tensor.
  const std::vector<Extent>& inputs() const { return in_; }
  const std::vector<Extent>& outputs() const { return out_; }
  // True when received blocks overlap (replicated kv heads gathered back): they are summed
  // into a zeroed output instead of copied.
  bool sums_received() const { return sums_; }
  // Elements all ranks together send (their own blocks included): the same on every rank, so
  // ranks choosing how to run an exchange by its size choose alike.
  int64_t total_elements() const { return total_; }

  bool operator==(const ExchangePlan& o) const;
  bool operator!=(const ExchangePlan& o) const { return !(*this == o); }

 private:
  ExchangePlan() = default;
  std::vector<int64_t> send_splits_, recv_splits_;  // One per rank.
  std::vector<ExchangeBlock> send_, recv_;          // Offsets are prefix sums of numel.
  std::vector<Extent> in_, out_;                    // One per tensor.
  bool sums_ = false;
  int64_t total_ = 0;
};
std::ostream& operator<<(std::ostream& os, const ExchangePlan& p);

}  // namespace ulysses
