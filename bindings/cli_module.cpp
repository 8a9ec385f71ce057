// ulysses._cli: the `ulysses` command (python -m ulysses). It joins the command tables of
// tools/ (train, plan, demo, launch) and bench/ (bench ...) and runs them with a Runtime whose
// process groups come from Python (torch.distributed). The library module (_C) carries none
// of this.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bench.h"
#include "commands.h"
#include "ulysses/group.h"

namespace py = pybind11;

namespace ulysses {
namespace {

// The command tables of tools/ and bench/, joined.
std::vector<cli::Command> all_commands() {
  std::vector<cli::Command> commands = cli::cli_commands();
  for (cli::Command& c : cli::bench_commands()) commands.push_back(std::move(c));
  return commands;
}

int run_cli(const std::vector<std::string>& argv, const std::vector<std::string>& self,
            const std::function<std::string(int64_t)>& join_world,
            const std::function<std::string(const std::vector<std::vector<int>>&)>& split) {
  cli::Runtime runtime;
  runtime.self = self;
  // The callbacks run Python (torch.distributed): they take the GIL, which run_cli releases.
  runtime.join_world = [&](const GroupOptions& options) {
    std::string name;
    {
      py::gil_scoped_acquire gil;
      name = join_world(options.timeout ? options.timeout->count() : -1);
    }
    return name.empty() ? Group::solo(options) : Group::resolve(name, options);
  };
  runtime.split = [&](const std::vector<std::vector<int>>& partition) {
    std::string name;
    {
      py::gil_scoped_acquire gil;
      name = split(partition);
    }
    return Group::resolve(name);
  };
  py::gil_scoped_release release;
  return cli::run_program(argv, all_commands(), runtime, ULYSSES_VERSION);
}

// The console command's first try (python/_ulysses_command.py, loaded without torch): runs the
// command line in a runtime without process groups, so a launcher starts its ranks and a bad
// command line is refused without importing torch. Returns the exit code, or nullopt where the
// command needs process groups in this process (then the caller runs it in a runtime that has
// them; nothing has been started or printed by then).
std::optional<int> run_cli_without_groups(const std::vector<std::string>& argv,
                                          const std::vector<std::string>& self) {
  cli::Runtime runtime;
  runtime.self = self;
  runtime.join_world = [](const GroupOptions&) -> Group { throw cli::NeedsProcessGroups{}; };
  runtime.split = [](const std::vector<std::vector<int>>&) -> Group {
    throw cli::NeedsProcessGroups{};
  };
  py::gil_scoped_release release;
  try {
    return cli::run_program(argv, all_commands(), runtime, ULYSSES_VERSION);
  } catch (const cli::NeedsProcessGroups&) {
    return std::nullopt;
  }
}

// Every command's options with their ranges: {command: [(option, kind, lo, hi, default)]}, kind
// "integer", "integers", "real", or "" for a flag or text (the tests walk them).
py::dict option_ranges() {
  py::dict out;
  for (const cli::Command& c : all_commands()) {
    py::list options;
    for (const cli::Option& o : c.options) {
      const char* kind = o.number == cli::Option::Number::kInteger    ? "integer"
                         : o.number == cli::Option::Number::kIntegers ? "integers"
                         : o.number == cli::Option::Number::kReal     ? "real"
                                                                      : "";
      options.append(py::make_tuple(o.name, kind, o.lo, o.hi, o.fallback.value_or("")));
    }
    out[py::str(c.name)] = options;
  }
  return out;
}

}  // namespace
}  // namespace ulysses

PYBIND11_MODULE(_cli, m) {
  m.doc() = "the ulysses command-line tool (train, plan, demo, bench, launch)";
  m.def("run_cli", &ulysses::run_cli, py::arg("argv"), py::arg("self"), py::arg("join_world"),
        py::arg("split"));
  m.def("run_cli_without_groups", &ulysses::run_cli_without_groups, py::arg("argv"),
        py::arg("self"));
  m.def("option_ranges", &ulysses::option_ranges);
}
