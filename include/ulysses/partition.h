// Head and sequence partitions: the pure plan layer of Ulysses sequence parallelism.
//
// A sequence of S tokens is split over the P ranks of a sequence-parallel (SP) group:
//   S_r = S/P + (r < S%P),   tokens of rank r = [sum_{j<r} S_j, sum_{j<=r} S_j).
// Around attention, heads are split instead. With r = Hq/Hkv query heads per kv head:
//   Hkv >= P:  kv[i] = Hkv/P + (i < Hkv%P) contiguous kv heads, q[i] = r * kv[i]
//              (a kv group is never torn apart);
//   Hkv <  P:  q[i] = Hq/P + (i < Hq%P) contiguous query heads, and rank i holds every kv head
//              its query heads use (kv heads are replicated over ranks).
// Local query head j of rank i uses local kv head kv_map(i)[j] = (q_begin(i)+j)/r - kv_begin(i).
//
// Everything here is a value computed from integers: no tensors, no process group, no state.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace ulysses {

// Dimension order of a 4-D Q/K/V/O tensor. B = batch, S = sequence, H = heads, D = head dim.
enum class Layout {
  kBSHD,  // [B, S, H, D]: flash-attention, Hugging Face.
  kSBHD,  // [S, B, H, D]: Megatron.
  kBHSD,  // [B, H, S, D]: scaled_dot_product_attention.
};

// The sequence dimension of `layout` (0..3).
int64_t seq_dim(Layout layout);
// The head dimension of `layout` (0..3).
int64_t head_dim(Layout layout);
// The batch dimension of `layout` (0..3).
int64_t batch_dim(Layout layout);
// "BSHD", "SBHD" or "BHSD".
std::string to_string(Layout layout);
// The permutation taking a tensor in `layout` to BHSD (x.permute(to_bhsd(layout))), and back.
std::vector<int64_t> to_bhsd(Layout layout);
std::vector<int64_t> from_bhsd(Layout layout);
// Parses "BSHD", "SBHD" or "BHSD" (case-insensitive); throws c10::ValueError otherwise.
Layout parse_layout(const std::string& name);

// A half-open range [begin, end) of indices.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range& o) const { return begin == o.begin && end == o.end; }
  bool operator!=(const Range& o) const { return !(*this == o); }
};
std::ostream& operator<<(std::ostream& os, const Range& r);

// The even split, the one rule for every split of n items into parts (heads, tokens, tiles):
// `parts` (>= 1) contiguous blocks covering [0, n), the first n % parts one item larger (so
// some are empty when n < parts), each scaled by `scale`.
std::vector<Range> even_split(int64_t n, int64_t parts, int64_t scale = 1);

// The head-count rule of an attention: both counts >= 1 and `q_heads` a multiple of
// `kv_heads`. Throws c10::ValueError "<who><q_name> (Hq) must be a multiple of <kv_name> (Hkv)"
// (or that both must be >= 1): callers name the counts as their users give them.
void check_head_counts(int64_t q_heads, int64_t kv_heads, const std::string& who,
                       const std::string& q_name = "query heads",
                       const std::string& kv_name = "kv heads");

// How the heads of one attention instance are split over an SP group of `sp_size` ranks.
// Computed identically on every rank from (Hq, Hkv, P); compare with ==, print with <<.
class HeadPartition {
 public:
  // Partitions `q_heads` query and `kv_heads` key/value heads over `sp_size` ranks.
  // Throws c10::ValueError when Hq % Hkv != 0, when Hq < P, or when a count is not positive.
  static HeadPartition make(int64_t q_heads, int64_t kv_heads, int64_t sp_size);

  int64_t q_heads() const { return q_heads_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t sp_size() const { return static_cast<int64_t>(q_.size()); }
  // Query heads that share one kv head (Hq / Hkv).
  int64_t group_size() const { return q_heads_ / kv_heads_; }
  // True when some kv head is held by more than one rank (Hkv < P).
  bool replicates_kv() const { return kv_heads_ < sp_size(); }

  // Global query heads [begin, end) held by `rank`.
  Range q_range(int64_t rank) const { return q_.at(rank); }
  // Global kv heads [begin, end) held by `rank`, replicas included.
  Range kv_range(int64_t rank) const { return kv_.at(rank); }
  // For each local query head of `rank`, the index of its kv head among the rank's kv heads.
  std::vector<int64_t> kv_map(int64_t rank) const;
  // Per-rank query (or kv) head ranges, in rank order.
  const std::vector<Range>& q_ranges() const { return q_; }
  const std::vector<Range>& kv_ranges() const { return kv_; }

  bool operator==(const HeadPartition& o) const {
    return q_heads_ == o.q_heads_ && kv_heads_ == o.kv_heads_ && q_ == o.q_ && kv_ == o.kv_;
  }
  bool operator!=(const HeadPartition& o) const { return !(*this == o); }

 private:
  HeadPartition() = default;
  int64_t q_heads_ = 0;    // > 0, a multiple of kv_heads_.
  int64_t kv_heads_ = 0;   // > 0.
  std::vector<Range> q_;   // One per rank; disjoint, contiguous, non-empty, covering [0, Hq).
  std::vector<Range> kv_;  // One per rank; covers [0, Hkv); ranges overlap only if Hkv < P.
};
std::ostream& operator<<(std::ostream& os, const HeadPartition& p);

// Note [Head chunks]: attention in `count` chunks of heads, each run as its own call (exchange,
// local attention, exchange back) so only one chunk's exchange buffers and whole-sequence copies
// exist at a time (what the kernel keeps for backward is every chunk's, as unchunked).
// Chunk c is the c-th even block of the kv heads with their query heads (kv groups kept whole),
// a contiguous block of every head tensor, so a chunk's inputs are slices of the call's. Each
// chunk needs >= P query heads; where its kv heads are fewer than P they are replicated within
// it, as in any call. Heads are independent, so the chunks' outputs, concatenated in order, are
// the unchunked call's.
//
// Note [Recomputed chunks]: what backward needs by heads (q, k, v and o over the whole sequence,
// every chunk's) otherwise lives from forward to backward, as much as the call's inputs and
// output together. With recompute_chunks a chunk runs without autograd and keeps only its
// inputs (slices of q, k, v, the mask and the sinks, which the caller holds anyway); its
// backward runs the chunk's first half again with autograd (agreement, exchange, mask) and
// backpropagates through that. On the fused kernel the chunk also keeps its row log-sum-exp by
// heads (S floats a head) and reads its heads of the call's o (held by the layer after it): the
// kernel's backward reads o only as delta = rowsum(do * o), which is made by sequence and goes
// to heads in one exchange with o's gradient (S floats a head). The kernel's backward then runs
// as after an unchunked forward, so the gradients are the kept chunks' bit for bit and the
// kernel's forward does not run again; q, k and v by heads are freed before the gradients go
// back. Elsewhere (SDPA, math, a callable, a ring) the whole chunk runs again (kernel and
// exchange back too). So one chunk's tensors by heads exist at a time in backward too, for one
// more exchange of q, k and v (and the kernel's forward elsewhere).
//
// Note [Overlapped chunks]: recomputed chunks run their forward as exchange to heads, kernel,
// exchange back, chunk after chunk; chunk i + 1's exchange to heads runs before chunk i's
// exchange back, on every rank alike. Where the group's CPU exchanges wait on links between
// hosts (Gloo's threads and the network carry them, and this thread only waits), chunk i's
// kernel runs on another thread meanwhile, so the link and the cores work at once; on one host
// the exchange is copies on the same cores as the kernel, and both run on this thread, one after
// the other (ULYSSES_OVERLAP_CHUNKS=1 or 0 overrides: the order of the collectives is the same
// either way, so ranks may differ). The forward builds no graph, so the other thread makes no
// autograd node (a node's sequence number, which orders backward, is its thread's). Kept chunks
// build their graph as they run, and backward runs one node at a time: both stay in turn. Only
// library kernels on CPU tensors overlap (a callable may run collectives; CUDA would need
// streams, not threads).
struct HeadChunk {
  Range q;
  Range kv;
};
// The chunks of `count` (>= 1) for an attention of (Hq, Hkv) over `sp_size` ranks; throws
// c10::ValueError when `count` < 1, > Hkv, or leaves a chunk with fewer query heads than ranks.
std::vector<HeadChunk> head_chunks(int64_t q_heads, int64_t kv_heads, int64_t sp_size,
                                   int64_t count);
// The count head_chunks="auto" takes. Kept chunks: the most, at most 4, whose kv heads are each
// at least `sp_size`, so none is replicated (1 where Hkv < 2P). Measured on a Llama-8B layer
// (docs/long_sequences.md), replication costs more than chunking saves, and past 4 chunks the
// transient falls by at most another eighth of the unchunked call's while each chunk adds a
// round and two exchanges. Recomputed chunks (`recompute`): the most the heads allow (each
// chunk >= P query heads), at most 8. What backward holds then falls as 1/count while the cost is
// the recomputation's, nearly flat in the count: on that layer at P = 2, 4 -> 8 chunks held 0.41
// -> 0.28 of the unchunked call's, step 0.79 -> 0.61x (P = 4: 0.52 -> 0.39, 0.91 -> 0.92x).
int64_t auto_head_chunks(int64_t q_heads, int64_t kv_heads, int64_t sp_size,
                         bool recompute = false);

// How S tokens are split over an SP group: contiguous, in rank order, S_r = S/P + (r < S%P),
// or given explicitly as per-rank lengths (learned from the ranks themselves).
class SequencePartition {
 public:
  // The even split of `seq_len` tokens over `sp_size` ranks. Throws c10::ValueError if
  // seq_len < 0 or sp_size < 1.
  static SequencePartition even(int64_t seq_len, int64_t sp_size);
  // The partition with the given per-rank lengths (each >= 0).
  static SequencePartition from_lengths(std::vector<int64_t> lengths);

  int64_t seq_len() const { return offsets_.back(); }
  int64_t sp_size() const { return static_cast<int64_t>(lengths_.size()); }
  // Tokens held by `rank`.
  int64_t length(int64_t rank) const { return lengths_.at(rank); }
  // Global token positions [begin, end) held by `rank`.
  Range range(int64_t rank) const { return {offsets_.at(rank), offsets_.at(rank + 1)}; }
  const std::vector<int64_t>& lengths() const { return lengths_; }

  bool operator==(const SequencePartition& o) const { return lengths_ == o.lengths_; }
  bool operator!=(const SequencePartition& o) const { return !(*this == o); }

 private:
  SequencePartition() = default;
  std::vector<int64_t> lengths_;  // One per rank, each >= 0.
  std::vector<int64_t> offsets_;  // Prefix sums of lengths_; size P + 1, offsets_[0] == 0.
};
std::ostream& operator<<(std::ostream& os, const SequencePartition& p);

}  // namespace ulysses
