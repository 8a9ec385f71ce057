// `ulysses plan`: prints the head (and sequence) partition of every rank.
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
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

}  // namespace

int plan_main(const Argv& argv) {
  Args args(argv, {"--json"});
  const int64_t hq = args.required_integer("--q-heads", 1, kMaxHeads);
  const int64_t hkv = args.integer("--kv-heads", hq, 1, kMaxHeads);
  const int64_t sp = args.required_integer("--sp", 1, kMaxRanks);
  const int64_t seq_len = args.integer("--seq-len", -1, 0);
  const bool json = args.has("--json");
  args.finish();

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
              << ", \"sp\": " << sp << "}\n";
    return 0;
  }
  std::cout << heads << "\n";
  std::cout << "rank  q_heads  q_range   kv_heads  kv_range  kv_map"
            << (seq.empty() ? "" : "  seq_len") << "\n";
  for (int64_t r = 0; r < sp; ++r) {
    std::ostringstream q, kv;
    q << heads.q_range(r);
    kv << heads.kv_range(r);
    std::printf("%-5ld %-8ld %-9s %-9ld %-9s %-7s", static_cast<long>(r),
                static_cast<long>(heads.q_range(r).size()), q.str().c_str(),
                static_cast<long>(heads.kv_range(r).size()), kv.str().c_str(),
                json_list(heads.kv_map(r), num).c_str());
    if (!seq.empty()) std::printf(" %ld", static_cast<long>(seq[r]));
    std::printf("\n");
  }
  if (heads.replicates_kv())
    std::cout << "kv heads are replicated (Hkv < P); their gradients are summed over replicas\n";
  return 0;
}

}  // namespace ulysses::cli
