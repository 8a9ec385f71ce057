// ulysses._plan: `ulysses plan` without torch. Built from the plan floor (c10 only), the command
// and the shared failure report, so the console command answers a planning question without
// importing torch or loading libtorch (python/_ulysses_command.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iostream>
#include <string>
#include <vector>

#include "plan.h"
#include "report.h"

namespace {

int run_plan(const std::vector<std::string>& args) {
  const int code =
      ulysses::cli::report_failures("plan", [&] { return ulysses::cli::plan_main(args); });
  std::cout.flush();
  return code;
}

}  // namespace

PYBIND11_MODULE(_plan, m) {
  m.doc() = "`ulysses plan`, built without torch (c10 and the plan floor)";
  m.def("run_plan", &run_plan, pybind11::arg("args"),
        "Runs `ulysses plan <args>` and returns its exit code.");
}
