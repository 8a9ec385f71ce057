// A small strict flag parser for the ulysses subcommands: `--name value` and `--flag`.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace ulysses::cli {

// Thrown for bad command lines: run_cli prints it on one line with where to find help, exit 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// `text` as it appears in a one-line message: control characters escaped as \xNN.
inline std::string shown(const std::string& text) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

class Args {
 public:
  // Parses `args`: `--name value`, `--name=value`, and the `flags`, which take no value. A token
  // starting with "--" is never taken as a value, so an unknown option is reported as unknown
  // (by finish) rather than swallowing the next option; "-5" still is a value.
  Args(const std::vector<std::string>& args, std::set<std::string> flags)
      : flags_(std::move(flags)) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a.size() < 2 || a[0] != '-') throw UsageError("unexpected argument '" + shown(a) + "'");
      const size_t eq = a.rfind("--", 0) == 0 ? a.find('=') : std::string::npos;
      if (eq != std::string::npos) {
        const std::string name = a.substr(0, eq);
        if (flags_.count(name)) throw UsageError("option " + shown(name) + " takes no value");
        values_[name] = a.substr(eq + 1);
      } else if (flags_.count(a)) {
        values_[a] = "1";
      } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        values_[a] = args[++i];
      } else {
        missing_value_.insert(a);  // An error once someone asks for it (else: unknown).
        values_[a] = "";
      }
    }
  }
  bool has(const std::string& name) {
    used_.insert(name);
    if (missing_value_.count(name)) throw UsageError("option " + shown(name) + " needs a value");
    return values_.count(name) > 0;
  }
  std::string str(const std::string& name, const std::string& fallback) {
    return has(name) ? values_[name] : fallback;
  }
  // The integer value of `name` (or `fallback`), which must lie in [lo, hi].
  int64_t integer(const std::string& name, int64_t fallback, int64_t lo = kMin, int64_t hi = kMax) {
    if (!has(name)) return fallback;
    int64_t v = 0;
    try {
      size_t end = 0;
      v = std::stoll(values_[name], &end);
      if (end != values_[name].size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      throw UsageError("option " + name + " must be an integer; got '" + shown(values_[name]) +
                       "'");
    }
    check_range(name, v, lo, hi);
    return v;
  }
  // The number value of `name` (or `fallback`), which must lie in [lo, hi].
  double real(const std::string& name, double fallback, double lo = -1e300, double hi = 1e300) {
    if (!has(name)) return fallback;
    double v = 0;
    try {
      size_t end = 0;
      v = std::stod(values_[name], &end);
      if (end != values_[name].size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      throw UsageError("option " + name + " must be a number; got '" + shown(values_[name]) + "'");
    }
    if (!(v >= lo && v <= hi)) {
      throw UsageError("option " + name + " must be in [" + std::to_string(lo) + ", " +
                       std::to_string(hi) + "]; got " + shown(values_[name]));
    }
    return v;
  }
  int64_t required_integer(const std::string& name, int64_t lo = kMin, int64_t hi = kMax) {
    if (!has(name)) throw UsageError("option " + name + " is required");
    return integer(name, 0, lo, hi);
  }
  // A comma-separated list of integers, each in [lo, hi].
  std::vector<int64_t> integers(const std::string& name, const std::string& fallback,
                                int64_t lo = kMin, int64_t hi = kMax) {
    const std::string text = str(name, fallback);
    std::vector<int64_t> out;
    size_t start = 0;
    while (start <= text.size()) {
      const size_t comma = std::min(text.find(',', start), text.size());
      const std::string item = text.substr(start, comma - start);
      try {
        size_t end = 0;
        out.push_back(std::stoll(item, &end));
        if (end != item.size()) throw std::invalid_argument("trailing characters");
      } catch (const std::exception&) {
        throw UsageError("option " + name + " must be a comma-separated list of integers; got '" +
                         shown(text) + "'");
      }
      check_range(name, out.back(), lo, hi);
      start = comma + 1;
    }
    return out;
  }
  // Call after reading every option: rejects options nobody asked for.
  void finish() const {
    for (const auto& kv : values_)
      if (!used_.count(kv.first)) throw UsageError("unknown option " + shown(kv.first));
  }

 private:
  static constexpr int64_t kMin = INT64_MIN, kMax = INT64_MAX;
  static void check_range(const std::string& name, int64_t v, int64_t lo, int64_t hi) {
    if (v >= lo && v <= hi) return;
    std::string range = hi == kMax ? ">= " + std::to_string(lo)
                                   : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    throw UsageError("option " + name + " must be " + range + "; got " + std::to_string(v));
  }
  std::set<std::string> flags_;
  std::map<std::string, std::string> values_;
  std::set<std::string> used_;
  std::set<std::string> missing_value_;  // Options given last, or before another option.
};

}  // namespace ulysses::cli
