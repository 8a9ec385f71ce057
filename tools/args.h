// A small strict flag parser for the ulysses subcommands: `--name value` and `--flag`.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace ulysses::cli {

// Thrown for bad command lines; main prints it with the subcommand's usage.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  // Parses `args`; `flags` take no value, every other `--name` takes one.
  Args(const std::vector<std::string>& args, std::set<std::string> flags) : flags_(std::move(flags)) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + a + "'");
      if (flags_.count(a)) {
        values_[a] = "1";
      } else {
        if (i + 1 >= args.size()) throw UsageError("option " + a + " needs a value");
        values_[a] = args[++i];
      }
    }
  }
  bool has(const std::string& name) {
    used_.insert(name);
    return values_.count(name) > 0;
  }
  std::string str(const std::string& name, const std::string& fallback) {
    return has(name) ? values_[name] : fallback;
  }
  int64_t integer(const std::string& name, int64_t fallback) {
    if (!has(name)) return fallback;
    try {
      size_t end = 0;
      const int64_t v = std::stoll(values_[name], &end);
      if (end == values_[name].size()) return v;
    } catch (const std::exception&) {
    }
    throw UsageError("option " + name + " must be an integer; got '" + values_[name] + "'");
  }
  double real(const std::string& name, double fallback) {
    if (!has(name)) return fallback;
    try {
      return std::stod(values_[name]);
    } catch (const std::exception&) {
      throw UsageError("option " + name + " must be a number; got '" + values_[name] + "'");
    }
  }
  int64_t required_integer(const std::string& name) {
    if (!has(name)) throw UsageError("option " + name + " is required");
    return integer(name, 0);
  }
  // Call after reading every option: rejects options nobody asked for.
  void finish() const {
    for (const auto& kv : values_)
      if (!used_.count(kv.first)) throw UsageError("unknown option " + kv.first);
  }

 private:
  std::set<std::string> flags_;
  std::map<std::string, std::string> values_;
  std::set<std::string> used_;
};

}  // namespace ulysses::cli
