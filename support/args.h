// A small strict option parser for the ulysses subcommands: `--name value` and `--flag`, from
// one table per command that also makes its help.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ulysses::cli {

using Argv = std::vector<std::string>;

// Most local ranks a subcommand starts (--nproc) or plans for (--sp).
constexpr int64_t kMaxRanks = 4096;
// Most attention heads an option accepts (--q-heads, --kv-heads): plans list every head.
constexpr int64_t kMaxHeads = 65536;

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

// One option of a command. A command's table of them makes both its help's synopsis and its
// parser, so the two cannot drift: what the help shows is what the parser takes, with the same
// default.
//
// A numeric option carries its range in the table (in(), each_in(), real_in()): the parser
// checks every given value against it before the command runs, and the help's tests walk the
// tables, so no command reads a number nobody bounded.
struct Option {
  // What a numeric option's value is.
  enum class Number { kNone, kInteger, kIntegers, kReal };

  std::string name;                     // "--seq-len" (or "-n").
  std::string shown;                    // Its value in the help: "256", "FILE"; "" for a flag.
  std::optional<std::string> fallback;  // The value when not given; none: simply absent.
  bool required = false;                // Shown without brackets; absent is a usage error.
  bool hidden = false;                  // Accepted, not shown (internal plumbing).
  Number number = Number::kNone;        // kNone: not a number (a flag, a path, a choice).
  double lo = 0, hi = 0;                // The number's range, both ends included.

  // This option as an integer in [lo, hi].
  Option in(int64_t low, int64_t high = INT64_MAX) const {
    return ranged(Number::kInteger, static_cast<double>(low), static_cast<double>(high));
  }
  // This option as a comma-separated list of integers, each in [lo, hi].
  Option each_in(int64_t low, int64_t high = INT64_MAX) const {
    return ranged(Number::kIntegers, static_cast<double>(low), static_cast<double>(high));
  }
  // This option as a real number in [lo, hi].
  Option real_in(double low, double high = 1e300) const { return ranged(Number::kReal, low, high); }

 private:
  Option ranged(Number kind, double low, double high) const {
    Option o = *this;
    o.number = kind, o.lo = low, o.hi = high;
    return o;
  }
};
using Options = std::vector<Option>;

// `--name value`, defaulting to `fallback` (which the help shows).
inline Option value(std::string name, std::string fallback) {
  return {std::move(name), fallback, fallback};
}
// `--name value` shown as `shown` ("0|1|both", "float32|bfloat16"), defaulting to `fallback`.
inline Option choice(std::string name, std::string shown, std::string fallback) {
  return {std::move(name), std::move(shown), std::move(fallback)};
}
// `--name VALUE` with no default: the command tells has() and reads it only when given.
inline Option placeholder(std::string name, std::string shown) {
  return {std::move(name), std::move(shown), std::nullopt};
}
inline Option flag(std::string name) { return {std::move(name), "", std::nullopt}; }
inline Option required(std::string name, std::string shown) {
  return {std::move(name), std::move(shown), std::nullopt, true};
}
inline Option hidden(std::string name) { return {std::move(name), "X", std::nullopt, false, true}; }

// The table as a synopsis: "[--nproc 4] [--check] --sp P ...", then `tail` ("-- <command>
// [args...]"), wrapped within `width` columns, the first line starting at column `column` and
// continuation lines indented by 8.
inline std::string synopsis(const Options& options, const std::string& tail = "", size_t column = 0,
                            size_t width = 92) {
  std::vector<std::string> items;
  for (const Option& o : options) {
    if (o.hidden) continue;
    const std::string item = o.shown.empty() ? o.name : o.name + " " + o.shown;
    items.push_back(o.required ? item : "[" + item + "]");
  }
  if (!tail.empty()) items.push_back(tail);
  std::string out, line;
  for (const std::string& item : items) {
    if (!line.empty() && column + line.size() + 1 + item.size() > width) {
      out += line + "\n";
      line = "       ";
      column = 0;
    }
    line += (line.empty() ? "" : " ") + item;
  }
  return out + line;
}

class Args {
 public:
  // Parses `args` against `options`: `--name value`, `--name=value`, and flags, which take no
  // value. A name not in the table is an unknown option; a token starting with "--" is never a
  // value (so "--jsn --seq-len 100" reports --jsn, not 100); "-5" still is a value.
  Args(const std::vector<std::string>& args, Options options) : options_(std::move(options)) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a.size() < 2 || a[0] != '-') throw UsageError("unexpected argument '" + shown(a) + "'");
      const size_t eq = a.rfind("--", 0) == 0 ? a.find('=') : std::string::npos;
      const std::string name = a.substr(0, eq);
      const Option* o = find(name);
      if (o == nullptr) throw UsageError("unknown option " + shown(name));
      if (o->shown.empty()) {
        if (eq != std::string::npos) throw UsageError("option " + shown(name) + " takes no value");
        values_[name] = "1";
      } else if (eq != std::string::npos) {
        values_[name] = a.substr(eq + 1);
      } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        values_[name] = args[++i];
      } else {
        throw UsageError("option " + shown(name) + " needs a value");
      }
    }
    // Every given number within its range, before the command runs.
    for (const auto& [name, text] : values_) check_number(*find(name));
  }
  // Whether `name` was given.
  bool has(const std::string& name) const {
    known(name);
    return values_.count(name) > 0;
  }
  // The value given, else the table's default, else "" (an option with no default).
  std::string str(const std::string& name) const {
    const Option& o = known(name);
    if (has(name)) return values_.at(name);
    if (o.required) throw UsageError("option " + name + " is required");
    return o.fallback.value_or("");
  }
  // The integer value (given, else the default), within the table's range.
  int64_t integer(const std::string& name) const {
    const Option& o = numeric(name, Option::Number::kInteger);
    return parse_integer(name, value_of(name), bound(o.lo), bound(o.hi));
  }
  // The number value (given, else the default), within the table's range.
  double real(const std::string& name) const {
    const Option& o = numeric(name, Option::Number::kReal);
    return parse_real(name, value_of(name), o.lo, o.hi);
  }
  // A comma-separated list of integers (given, else the default), each within the table's range.
  std::vector<int64_t> integers(const std::string& name) const {
    const Option& o = numeric(name, Option::Number::kIntegers);
    return parse_integers(name, value_of(name), bound(o.lo), bound(o.hi));
  }

 private:
  static constexpr int64_t kMin = INT64_MIN, kMax = INT64_MAX;
  static constexpr double kMaxReal = 1e300;
  // A range end as an integer (INT64_MAX's double rounds up past it).
  static int64_t bound(double v) {
    return v >= 9.2e18 ? kMax : v <= -9.2e18 ? kMin : static_cast<int64_t>(v);
  }
  // The option `name` as the command reads it: a number of this kind with a range.
  const Option& numeric(const std::string& name, Option::Number kind) const {
    const Option& o = known(name);
    if (o.number != kind) {
      throw std::logic_error("option " + name +
                             " is read as a number of another kind than its table's");
    }
    return o;
  }
  void check_number(const Option& o) const {
    const std::string& text = values_.at(o.name);
    if (o.number == Option::Number::kInteger) parse_integer(o.name, text, bound(o.lo), bound(o.hi));
    if (o.number == Option::Number::kIntegers)
      parse_integers(o.name, text, bound(o.lo), bound(o.hi));
    if (o.number == Option::Number::kReal) parse_real(o.name, text, o.lo, o.hi);
  }
  static int64_t parse_integer(const std::string& name, const std::string& text, int64_t lo,
                               int64_t hi) {
    int64_t v = 0;
    try {
      size_t end = 0;
      v = std::stoll(text, &end);
      if (end != text.size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      throw UsageError("option " + name + " must be an integer; got '" + shown(text) + "'");
    }
    check_range(name, v, lo, hi);
    return v;
  }
  static double parse_real(const std::string& name, const std::string& text, double lo, double hi) {
    double v = 0;
    try {
      size_t end = 0;
      v = std::stod(text, &end);
      if (end != text.size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      throw UsageError("option " + name + " must be a number; got '" + shown(text) + "'");
    }
    if (!(v >= lo && v <= hi)) {
      std::ostringstream range;  // "0", "10", "0.5": as typed, not to_string's 6 decimals.
      if (hi == kMaxReal) {
        range << ">= " << lo;
      } else {
        range << "in [" << lo << ", " << hi << "]";
      }
      throw UsageError("option " + name + " must be " + range.str() + "; got " + shown(text));
    }
    return v;
  }
  static std::vector<int64_t> parse_integers(const std::string& name, const std::string& text,
                                             int64_t lo, int64_t hi) {
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
  const Option* find(const std::string& name) const {
    for (const Option& o : options_)
      if (o.name == name) return &o;
    return nullptr;
  }
  // Reading an option the table lacks is the command's bug, not the user's.
  const Option& known(const std::string& name) const {
    const Option* o = find(name);
    if (o == nullptr) throw std::logic_error("option " + name + " is not in the command's table");
    return *o;
  }
  std::string value_of(const std::string& name) const {
    const Option& o = known(name);
    if (!has(name) && !o.required && !o.fallback) {
      throw std::logic_error("option " + name + " has no default: ask has() first");
    }
    return str(name);
  }
  static void check_range(const std::string& name, int64_t v, int64_t lo, int64_t hi) {
    if (v >= lo && v <= hi) return;
    std::string range = hi == kMax ? ">= " + std::to_string(lo)
                                   : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    throw UsageError("option " + name + " must be " + range + "; got " + std::to_string(v));
  }
  Options options_;
  std::map<std::string, std::string> values_;
};

}  // namespace ulysses::cli
