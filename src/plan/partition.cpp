#include "ulysses/partition.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>

namespace ulysses {

namespace {

// Every fact about a layout, in one table.
struct LayoutFacts {
  Layout layout;
  const char* name;
  int64_t seq_dim, head_dim, batch_dim;
  std::array<int64_t, 4> to_bhsd;  // Permutation taking the layout to BHSD.
};

constexpr LayoutFacts kLayouts[] = {
    {Layout::kBSHD, "BSHD", 1, 2, 0, {0, 2, 1, 3}},
    {Layout::kSBHD, "SBHD", 0, 2, 1, {1, 2, 0, 3}},
    {Layout::kBHSD, "BHSD", 2, 1, 0, {0, 1, 2, 3}},
};

const LayoutFacts& facts(Layout layout) {
  for (const LayoutFacts& f : kLayouts)
    if (f.layout == layout) return f;
  TORCH_INTERNAL_ASSERT(false, "unknown layout");
}

}  // namespace

int64_t seq_dim(Layout layout) { return facts(layout).seq_dim; }
int64_t head_dim(Layout layout) { return facts(layout).head_dim; }
int64_t batch_dim(Layout layout) { return facts(layout).batch_dim; }
std::string to_string(Layout layout) { return facts(layout).name; }

std::vector<int64_t> to_bhsd(Layout layout) {
  const auto& p = facts(layout).to_bhsd;
  return {p.begin(), p.end()};
}

std::vector<int64_t> from_bhsd(Layout layout) {
  const auto& p = facts(layout).to_bhsd;
  std::vector<int64_t> inverse(4);
  for (int64_t i = 0; i < 4; ++i) inverse[p[i]] = i;
  return inverse;
}

Layout parse_layout(const std::string& name) {
  std::string upper = name;
  std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
  for (const LayoutFacts& f : kLayouts)
    if (upper == f.name) return f.layout;
  TORCH_CHECK_VALUE(false, "parse_layout: layout must be one of BSHD, SBHD, BHSD; got '", name,
                    "'");
}

std::ostream& operator<<(std::ostream& os, const Range& r) {
  return os << "[" << r.begin << ", " << r.end << ")";
}

std::vector<Range> even_split(int64_t n, int64_t parts, int64_t scale) {
  TORCH_CHECK_VALUE(n >= 0 && parts >= 1, "even_split: need n >= 0 items and parts >= 1; got n ", n,
                    ", parts ", parts);
  std::vector<Range> out;
  int64_t begin = 0;
  for (int64_t i = 0; i < parts; ++i) {
    int64_t size = n / parts + (i < n % parts ? 1 : 0);
    out.push_back({begin * scale, (begin + size) * scale});
    begin += size;
  }
  return out;
}

void check_head_counts(int64_t q_heads, int64_t kv_heads, const std::string& who,
                       const std::string& q_name, const std::string& kv_name) {
  TORCH_CHECK_VALUE(q_heads >= 1 && kv_heads >= 1, who, "head counts must be >= 1; got ", q_name,
                    " ", q_heads, ", ", kv_name, " ", kv_heads);
  TORCH_CHECK_VALUE(q_heads % kv_heads == 0, who, q_name, " (", q_heads, ") must be a multiple of ",
                    kv_name, " (", kv_heads, ")");
}

HeadPartition HeadPartition::make(int64_t q_heads, int64_t kv_heads, int64_t sp_size) {
  TORCH_CHECK_VALUE(sp_size >= 1, "HeadPartition: sequence-parallel size must be >= 1; got ",
                    sp_size);
  check_head_counts(q_heads, kv_heads, "HeadPartition: ");
  TORCH_CHECK_VALUE(q_heads >= sp_size, "HeadPartition: query heads (", q_heads,
                    ") must be >= sequence-parallel size (", sp_size,
                    "); each rank needs at least one query head; use an SP group of at most ",
                    q_heads, " rank", q_heads == 1 ? "" : "s");
  HeadPartition p;
  p.q_heads_ = q_heads;
  p.kv_heads_ = kv_heads;
  const int64_t group = q_heads / kv_heads;
  if (kv_heads >= sp_size) {
    p.kv_ = even_split(kv_heads, sp_size);
    p.q_ = even_split(kv_heads, sp_size, group);
  } else {
    p.q_ = even_split(q_heads, sp_size);
    for (const Range& q : p.q_) p.kv_.push_back({q.begin / group, (q.end - 1) / group + 1});
  }
  return p;
}

std::vector<int64_t> HeadPartition::kv_map(int64_t rank) const {
  const Range q = q_range(rank);
  const Range kv = kv_range(rank);
  std::vector<int64_t> map;
  for (int64_t h = q.begin; h < q.end; ++h) map.push_back(h / group_size() - kv.begin);
  return map;
}

std::vector<HeadChunk> head_chunks(int64_t q_heads, int64_t kv_heads, int64_t sp_size,
                                   int64_t count) {
  HeadPartition::make(q_heads, kv_heads, sp_size);  // The counts' own checks.
  TORCH_CHECK_VALUE(count >= 1 && count <= kv_heads, "head_chunks: ", count,
                    " chunks of an attention with ", kv_heads, " kv heads; give 1 to ", kv_heads,
                    " (a chunk keeps kv groups whole)");
  const int64_t group = q_heads / kv_heads;
  std::vector<HeadChunk> chunks;
  for (const Range& kv : even_split(kv_heads, count)) {
    chunks.push_back({{kv.begin * group, kv.end * group}, kv});
    TORCH_CHECK_VALUE(chunks.back().q.size() >= sp_size, "head_chunks: ", count, " chunks of ",
                      q_heads, " query heads leave a chunk with ", chunks.back().q.size(),
                      ", fewer than the ", sp_size, " ranks of the group; give fewer chunks");
  }
  return chunks;
}

int64_t auto_head_chunks(int64_t q_heads, int64_t kv_heads, int64_t sp_size, bool recompute) {
  TORCH_CHECK_VALUE(q_heads >= 1 && kv_heads >= 1 && sp_size >= 1,
                    "auto_head_chunks: q_heads, kv_heads and sp_size must be >= 1; got ", q_heads,
                    ", ", kv_heads, " and ", sp_size);
  if (!recompute) {
    constexpr int64_t kMost = 4;
    return std::clamp<int64_t>(kv_heads / sp_size, 1, kMost);
  }
  constexpr int64_t kMostRecomputed = 8;
  const int64_t group = std::max<int64_t>(q_heads / kv_heads, 1);
  for (int64_t count = std::min(kv_heads, kMostRecomputed); count > 1; --count) {
    if (group * (kv_heads / count) >= sp_size) return count;  // Its smallest chunk's q heads.
  }
  return 1;
}

std::ostream& operator<<(std::ostream& os, const HeadPartition& p) {
  os << "HeadPartition(q_heads=" << p.q_heads() << ", kv_heads=" << p.kv_heads()
     << ", sp=" << p.sp_size() << ", q=";
  for (const Range& r : p.q_ranges()) os << r;
  os << ", kv=";
  for (const Range& r : p.kv_ranges()) os << r;
  return os << ")";
}

SequencePartition SequencePartition::even(int64_t seq_len, int64_t sp_size) {
  TORCH_CHECK_VALUE(sp_size >= 1, "SequencePartition: sequence-parallel size must be >= 1; got ",
                    sp_size);
  TORCH_CHECK_VALUE(seq_len >= 0, "SequencePartition: sequence length must be >= 0; got ", seq_len);
  std::vector<int64_t> lengths;
  for (const Range& r : even_split(seq_len, sp_size)) lengths.push_back(r.size());
  return from_lengths(std::move(lengths));
}

SequencePartition SequencePartition::from_lengths(std::vector<int64_t> lengths) {
  TORCH_CHECK_VALUE(!lengths.empty(), "SequencePartition: need at least one rank");
  SequencePartition p;
  p.offsets_.push_back(0);
  for (int64_t n : lengths) {
    TORCH_CHECK_VALUE(n >= 0, "SequencePartition: local lengths must be >= 0; got ", n);
    p.offsets_.push_back(p.offsets_.back() + n);
  }
  p.lengths_ = std::move(lengths);
  return p;
}

std::ostream& operator<<(std::ostream& os, const SequencePartition& p) {
  os << "SequencePartition(S=" << p.seq_len() << ", lengths=[";
  for (int64_t i = 0; i < p.sp_size(); ++i) os << (i ? "," : "") << p.length(i);
  return os << "])";
}

}  // namespace ulysses
