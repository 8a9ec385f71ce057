// Shared pieces of the `ulysses bench` drivers: timing statistics, peak-memory measurement in
// a child process, and result records printed as a table and written as JSON.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ulysses/group.h"

namespace ulysses::bench {

// Wall-clock milliseconds over repeated runs after warm-up.
struct Stats {
  double median = 0, min = 0, max = 0;
};

// Median, min and max of `samples` (all zero when empty).
Stats stats_of(std::vector<double> samples);

// Runs `fn` `warmup` times, then `repeats` times, timing each of the latter.
Stats time_ms(const std::function<void()>& fn, int warmup, int repeats);

// Like time_ms for a step every rank of `group` runs: each repeat starts after a barrier, and
// its sample is the slowest rank's time (a collective step is as slow as its slowest rank).
// Every rank returns the same statistics.
Stats time_slowest_rank(const Group& group, const std::function<void()>& fn, int warmup,
                        int repeats);

// Several steps timed side by side: each repeat runs every step once, in turn (after a
// barrier; the sample is the slowest rank's time), so the machine's drift hits them alike.
struct SideBySide {
  std::vector<Stats> steps;  // One per step.
  // The ratio step[a] / step[b] taken within each repeat: median, min, max.
  Stats ratio(size_t a, size_t b) const;
  std::vector<std::vector<double>> samples;  // [step][repeat].
};
SideBySide time_side_by_side(const Group& group, const std::vector<std::function<void()>>& steps,
                             int warmup, int repeats);

// Peak resident memory that `run` adds on top of what `prepare` left, in this process: VmHWM
// after `run` minus VmRSS after `prepare`, with the high-water mark reset in between. Run it in
// a fresh process (see peak_in_child) so earlier allocations do not hide the peak.
int64_t peak_extra_bytes(const std::function<void()>& prepare, const std::function<void()>& run);

// Runs `self args...` (this tool) in a fresh process (not fork: OpenMP does not survive a
// fork) and returns the number it printed on a line "peak_extra_bytes: N", or -1 if it died
// (e.g. out of memory) or printed none.
int64_t peak_in_child(const std::vector<std::string>& self, const std::vector<std::string>& args);

// One benchmark case: ordered (name, JSON value) fields.
class Record {
 public:
  Record& add(const std::string& name, int64_t v);
  Record& add(const std::string& name, int v) { return add(name, static_cast<int64_t>(v)); }
  Record& add(const std::string& name, double v);
  Record& add(const std::string& name, bool v);
  Record& add(const std::string& name, const std::string& v);
  Record& add(const std::string& name, const char* v) { return add(name, std::string(v)); }
  // Timing statistics as numbers: <name>_ms (median), <name>_min_ms, <name>_max_ms.
  Record& add(const std::string& name, const Stats& s);
  // A ratio's statistics: <name> (median), <name>_min, <name>_max.
  Record& add_ratio(const std::string& name, const Stats& s);
  std::string json() const;
  // The field's text as printed in tables ("" if absent). "<name>_spread" is shown as
  // "(min-max)" from the fields that add(name, Stats) or add_ratio wrote.
  std::string text(const std::string& name) const;

 private:
  std::vector<std::pair<std::string, std::string>> fields_;  // Values JSON-encoded.
};

// The shared object that provides the BLAS `sgemm_` the attention kernel calls.
std::string gemm_library();

// Where the ranks' Gloo runs: "Gloo across test hosts (<rate> bit/s)" under
// scripts/netns_hosts.sh (which sets LINK_RATE_BITS), else "Gloo on loopback".
std::string where_ranks_run();

// Prints `records` as an aligned table of `columns`, leaving out columns no record has.
void print_table(const std::vector<Record>& records, const std::vector<std::string>& columns);
// Writes `records` as a JSON array to `path`.
void write_json(const std::string& path, const std::vector<Record>& records);

}  // namespace ulysses::bench
