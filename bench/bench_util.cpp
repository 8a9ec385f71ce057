#include "bench_util.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "proc_status.h"

extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*,
                       const int*);

namespace ulysses::bench {

Stats stats_of(std::vector<double> samples) {
  if (samples.empty()) return {};
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  const double median = n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
  return {median, samples.front(), samples.back()};
}

Stats time_ms(const std::function<void()>& fn, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return stats_of(std::move(ms));
}

Stats time_slowest_rank(const Group& group, const std::function<void()>& fn, int warmup,
                        int repeats) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> samples;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    group.barrier();
    const double one = time_ms(fn, 0, 1).median;
    samples.push_back(group.all_gather(at::tensor({one}, at::kDouble)).max().item<double>());
  }
  return stats_of(std::move(samples));
}

SideBySide time_side_by_side(const Group& group, const std::vector<std::function<void()>>& steps,
                             int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i)
    for (const auto& step : steps) step();
  SideBySide out;
  out.samples.resize(steps.size());
  for (int i = 0; i < std::max(1, repeats); ++i) {
    for (size_t s = 0; s < steps.size(); ++s) {
      out.samples[s].push_back(time_slowest_rank(group, steps[s], 0, 1).median);
    }
  }
  for (const auto& samples : out.samples) out.steps.push_back(stats_of(samples));
  return out;
}

Stats SideBySide::ratio(size_t a, size_t b) const {
  std::vector<double> r;
  for (size_t i = 0; i < samples[a].size(); ++i) r.push_back(samples[a][i] / samples[b][i]);
  return stats_of(std::move(r));
}

int64_t peak_extra_bytes(const std::function<void()>& prepare, const std::function<void()>& run) {
  prepare();
  std::ofstream("/proc/self/clear_refs") << "5";  // Reset VmHWM to the current RSS.
  const int64_t base = cli::proc_status_bytes("VmRSS");
  run();
  return cli::proc_status_bytes("VmHWM") - base;
}

int64_t peak_in_child(const std::vector<std::string>& self, const std::vector<std::string>& args) {
  std::string command;
  for (const auto& a : self) command += "'" + a + "' ";
  for (const auto& a : args) command += " '" + a + "'";
  FILE* pipe = ::popen((command + " 2>/dev/null").c_str(), "r");
  if (!pipe) return -1;
  int64_t result = -1;
  char line[512];
  const std::string key = "peak_extra_bytes: ";
  while (std::fgets(line, sizeof(line), pipe)) {
    const std::string s(line);
    if (s.rfind(key, 0) == 0) result = std::stoll(s.substr(key.size()));
  }
  return ::pclose(pipe) == 0 ? result : -1;
}

Record& Record::add(const std::string& name, int64_t v) {
  fields_.emplace_back(name, std::to_string(v));
  return *this;
}
Record& Record::add(const std::string& name, double v) {
  std::ostringstream os;
  os << std::setprecision(6) << v;
  fields_.emplace_back(name, os.str());
  return *this;
}
Record& Record::add(const std::string& name, bool v) {
  fields_.emplace_back(name, v ? "true" : "false");
  return *this;
}
Record& Record::add(const std::string& name, const std::string& v) {
  fields_.emplace_back(name, "\"" + v + "\"");
  return *this;
}

std::string Record::json() const {
  std::string out = "{";
  for (size_t i = 0; i < fields_.size(); ++i)
    out += (i ? ", \"" : "\"") + fields_[i].first + "\": " + fields_[i].second;
  return out + "}";
}

Record& Record::add(const std::string& name, const Stats& s) {
  return add(name + "_ms", s.median).add(name + "_min_ms", s.min).add(name + "_max_ms", s.max);
}

Record& Record::add_ratio(const std::string& name, const Stats& s) {
  return add(name, s.median).add(name + "_min", s.min).add(name + "_max", s.max);
}

std::string Record::text(const std::string& name) const {
  for (const auto& f : fields_) {
    if (f.first != name) continue;
    std::string v = f.second;
    if (!v.empty() && v.front() == '"') v = v.substr(1, v.size() - 2);
    return v;
  }
  const std::string suffix = "_spread";
  if (name.size() > suffix.size() &&
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const std::string base = name.substr(0, name.size() - suffix.size());
    const bool ms = !text(base + "_min_ms").empty();
    const std::string lo = text(base + (ms ? "_min_ms" : "_min"));
    const std::string hi = text(base + (ms ? "_max_ms" : "_max"));
    if (lo.empty() || hi.empty()) return "";
    std::ostringstream os;
    os << std::fixed << std::setprecision(ms ? 1 : 2) << "(" << std::stod(lo) << "-"
       << std::stod(hi) << ")";
    return os.str();
  }
  return "";
}

std::string where_ranks_run() {
  const char* link = std::getenv("LINK_RATE_BITS");
  return link ? std::string("Gloo across test hosts (") + link + " bit/s)" : "Gloo on loopback";
}

std::string gemm_library() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&sgemm_), &info) && info.dli_fname) return info.dli_fname;
  return "unknown";
}

void print_table(const std::vector<Record>& records, const std::vector<std::string>& wanted) {
  std::vector<std::string> columns;
  for (const auto& c : wanted) {
    for (const auto& r : records) {
      if (!r.text(c).empty()) {
        columns.push_back(c);
        break;
      }
    }
  }
  std::vector<size_t> width;
  for (const auto& c : columns) {
    size_t w = c.size();
    for (const auto& r : records) w = std::max(w, r.text(c).size());
    width.push_back(w);
  }
  for (size_t i = 0; i < columns.size(); ++i)
    std::cout << std::left << std::setw(width[i] + 2) << columns[i];
  std::cout << "\n";
  for (const auto& r : records) {
    for (size_t i = 0; i < columns.size(); ++i)
      std::cout << std::left << std::setw(width[i] + 2) << r.text(columns[i]);
    std::cout << "\n";
  }
  std::cout.flush();
}

void write_json(const std::string& path, const std::vector<Record>& records) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << "[\n";
  for (size_t i = 0; i < records.size(); ++i)
    out << "  " << records[i].json() << (i + 1 < records.size() ? ",\n" : "\n");
  out << "]\n";
}

}  // namespace ulysses::bench
