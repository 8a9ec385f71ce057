// `ulysses plan`: prints the head (and sequence) partition of every rank.
#include "plan.h"

#include <algorithm>
#include <iostream>
#include <sstream>

#include "args.h"
#include "ulysses/mesh_plan.h"
#include "ulysses/partition.h"

namespace ulysses::cli {
namespace {

template <class T, class F>
std::string json_list(const std::vector<T>& items, F&& fmt) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < items.size(); ++i) os << (i ? ", " : "") << fmt(items[i]);
  os << "]";
  return os.str();
}

std::string range_json(const Range& r) {
  return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + "]";
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << bytes / 1048576.0;
  return os.str();
}

// Rows of cells in left-aligned columns two spaces apart, each as wide as its widest cell.
void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], row[c].size());
    }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c)
      line += c + 1 < row.size() ? row[c] + std::string(width[c] - row[c].size() + 2, ' ') : row[c];
    std::cout << line << "\n";
  }
}

// The U x R splits of sp ranks, best first (see plan_sp_mesh). In JSON: the tail of an object.
void print_meshes(const std::vector<MeshCost>& meshes, const LayerShape& s, int64_t sp, bool json) {
  if (json) {
    std::cout << "\"meshes\": "
              << json_list(meshes,
                           [](const MeshCost& c) {
                             std::ostringstream os;
                             os << "{\"ulysses\": " << c.ulysses << ", \"ring\": " << c.ring
                                << ", \"a2a_bytes\": " << c.a2a_bytes
                                << ", \"ring_bytes\": " << c.ring_bytes
                                << ", \"ring_messages\": " << c.ring_messages
                                << ", \"peak_bytes\": " << c.peak_bytes
                                << ", \"kv_replicas\": " << c.kv_replicas << "}";
                             return os.str();
                           })
              << ", \"recommended\": \"" << meshes.front().describe() << "\"}\n";
    return;
  }
  std::cout << "sp " << sp << " = Ulysses U x ring R, per rank and attention layer (forward + "
            << "backward) at seq_len " << s.seq_len << ", head_dim " << s.head_dim << ", batch "
            << s.batch << ", " << s.elem_bytes << "-byte elements:\n";
  std::vector<std::vector<std::string>> table{
      {"U x R", "kv copies", "a2a MiB", "ring MiB", "ring sends", "total MiB", "peak MiB"}};
  for (const MeshCost& c : meshes) {
    table.push_back({c.describe(), std::to_string(c.kv_replicas), mib(c.a2a_bytes),
                     mib(c.ring_bytes), std::to_string(c.ring_messages),
                     mib(c.a2a_bytes + c.ring_bytes), mib(c.peak_bytes)});
  }
  print_table(table);
  std::cout << "recommended: " << meshes.front().describe()
            << " (fewest bytes moved; ties to the smaller peak)\n";
}

}  // namespace

const Options& plan_options() {
  static const Options options{required("--q-heads", "N").in(1, kMaxHeads),
                               placeholder("--kv-heads", "N").in(1, kMaxHeads),
                               required("--sp", "P").in(1, kMaxRanks),
                               placeholder("--seq-len", "S").in(1),
                               value("--head-dim", "128").in(1, int64_t{1} << 16),
                               value("--batch", "1").in(1, int64_t{1} << 20),
                               value("--elem-bytes", "2").in(1, 8),
                               flag("--json")};
  return options;
}

int plan_main(const Argv& argv) {
  const Args args(argv, plan_options());
  const int64_t hq = args.integer("--q-heads");
  const int64_t hkv = args.has("--kv-heads") ? args.integer("--kv-heads") : hq;
  const int64_t sp = args.integer("--sp");
  const int64_t seq_len = args.has("--seq-len") ? args.integer("--seq-len") : -1;
  LayerShape shape;
  shape.q_heads = hq, shape.kv_heads = hkv;
  shape.seq_len = seq_len >= 0 ? seq_len : 32768;
  shape.head_dim = args.integer("--head-dim");
  shape.batch = args.integer("--batch");
  shape.elem_bytes = args.integer("--elem-bytes");
  const bool json = args.has("--json");

  const std::vector<MeshCost> meshes = plan_sp_mesh(sp, shape);
  if (hq < sp) {  // Only hybrid splits exist: no partition of every head over sp ranks.
    if (json) {
      std::cout << "{\"total_q_heads\": " << hq << ", \"total_kv_heads\": " << hkv
                << ", \"sp\": " << sp << ", ";
    }
    print_meshes(meshes, shape, sp, json);
    return 0;
  }
  const HeadPartition heads = HeadPartition::make(hq, hkv, sp);
  std::vector<int64_t> ranks;
  for (int64_t r = 0; r < sp; ++r) ranks.push_back(r);
  const auto seq = seq_len >= 0
                       ? std::vector<int64_t>(SequencePartition::even(seq_len, sp).lengths())
                       : std::vector<int64_t>{};
  auto size_of = [](const Range& r) { return std::to_string(r.size()); };
  auto num = [](int64_t v) { return std::to_string(v); };
  if (json) {
    std::cout << "{\"q_heads\": " << json_list(heads.q_ranges(), size_of)
              << ", \"kv_heads\": " << json_list(heads.kv_ranges(), size_of)
              << ", \"q_ranges\": " << json_list(heads.q_ranges(), range_json)
              << ", \"kv_ranges\": " << json_list(heads.kv_ranges(), range_json) << ", \"kv_map\": "
              << json_list(ranks, [&](int64_t r) { return json_list(heads.kv_map(r), num); });
    if (!seq.empty()) std::cout << ", \"seq_lens\": " << json_list(seq, num);
    std::cout << ", \"total_q_heads\": " << hq << ", \"total_kv_heads\": " << hkv
              << ", \"sp\": " << sp << ", ";
    print_meshes(meshes, shape, sp, json);
    return 0;
  }
  std::cout << heads << "\n";
  std::vector<std::vector<std::string>> table{
      {"rank", "q_heads", "q_range", "kv_heads", "kv_range", "kv_map"}};
  if (!seq.empty()) table[0].push_back("seq_len");
  for (int64_t r = 0; r < sp; ++r) {
    std::ostringstream q, kv;
    q << heads.q_range(r);
    kv << heads.kv_range(r);
    table.push_back({num(r), size_of(heads.q_range(r)), q.str(), size_of(heads.kv_range(r)),
                     kv.str(), json_list(heads.kv_map(r), num)});
    if (!seq.empty()) table.back().push_back(num(seq[r]));
  }
  print_table(table);
  if (heads.replicates_kv())
    std::cout << "kv heads are replicated (Hkv < P); their gradients are summed over replicas\n";
  std::cout << "\n";
  print_meshes(meshes, shape, sp, json);
  return 0;
}

}  // namespace ulysses::cli
