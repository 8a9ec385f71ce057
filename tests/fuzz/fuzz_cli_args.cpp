// Fuzzes the CLI's argument parser: any argv (NUL-separated words) either parses or throws
// UsageError with a one-line message; `ulysses plan` runs end to end on what parses.
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <vector>

#include "args.h"
#include "commands.h"
#include "fuzz_input.h"

using ulysses::cli::Args;
using ulysses::cli::UsageError;

namespace {

std::vector<std::string> words(const uint8_t* data, size_t size) {
  std::vector<std::string> out(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      out.emplace_back();
    } else {
      out.back().push_back(static_cast<char>(data[i]));
    }
  }
  if (out.back().empty()) out.pop_back();
  return out;
}

// Errors reach the user as one line (run_cli prints them after "error: ").
void check_one_line(const std::string& what) {
  FUZZ_CHECK(!what.empty() && what.find('\n') == std::string::npos);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = std::freopen("/dev/null", "w", stdout) != nullptr;  // plan's table
  (void)quiet;
  const std::vector<std::string> argv = words(data, size);
  try {
    using namespace ulysses::cli;
    const Args args(argv, {flag("--json"), flag("--flag"), value("--n", "3").in(-5, 70),
                           value("--x", "0.5").real_in(0.0, 1.0),
                           value("--list", "1,2").each_in(0, 1000), placeholder("--name", "NAME")});
    const int64_t n = args.integer("--n");
    FUZZ_CHECK(n >= -5 && n <= 70);
    const double x = args.real("--x");
    FUZZ_CHECK(x >= 0.0 && x <= 1.0);
    for (int64_t v : args.integers("--list")) FUZZ_CHECK(v >= 0 && v <= 1000);
    args.str("--name");
    args.has("--json");
  } catch (const UsageError& e) {
    check_one_line(e.what());
  }
  // The same words as `ulysses plan`'s options: a usage error, a planner error, or a plan.
  try {
    ulysses::cli::plan_main(argv);
  } catch (const UsageError& e) {
    check_one_line(e.what());
  } catch (const c10::ValueError& e) {
    check_one_line(e.what_without_backtrace());
  }
  return 0;
}
