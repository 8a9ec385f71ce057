// What the command-line programs share (tools/: the CLI, bench/: the benchmarks): the host
// runtime, the command table and its runner, process-group options and the local launcher.
// tools/ and bench/ both build on this and never on each other; bindings/programs.cpp joins
// their command tables into the `ulysses` command.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "args.h"
#include "ulysses/group.h"
#include "ulysses/mesh.h"

namespace ulysses::cli {

// What the subcommands need from the program that hosts them (the Python front end, which
// owns process groups: torch.distributed creates them, C++ resolves them by name).
struct Runtime {
  // The command that runs this tool again, e.g. {"/venv/bin/python", "-m", "ulysses"}.
  Argv self;
  // Joins the world group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
  // MASTER_PORT); a process outside any launcher is a world of one rank. Called once.
  std::function<Group(const GroupOptions&)> join_world;
  // Creates this rank's sub-group of the world (see Mesh::Split).
  Mesh::Split split;
};

// One subcommand: its name as typed ("train", "bench a2a"), its option table (the help's
// synopsis and the parser its body builds from the same table), what follows the options
// (launch's "-- <command>"), what it does, and its body (the arguments after the name; returns
// the exit code; throws UsageError for a bad command line).
struct Command {
  std::string name;
  Options options;
  std::string tail;
  std::string about;
  std::function<int(const Argv&, const Runtime&)> run;
};

// A command body that needs no runtime (plan, launch, bench gemm).
inline std::function<int(const Argv&, const Runtime&)> without_runtime(int (*main)(const Argv&)) {
  return [main](const Argv& args, const Runtime&) { return main(args); };
}

// Runs `ulysses <argv...>` over `commands`: help, --version, dispatch, and every error as one
// line naming the command (exit 2 for usage, 1 for failures). Returns the exit code.
int run_program(const Argv& argv, const std::vector<Command>& commands, const Runtime& runtime,
                const std::string& version);

// The process-group options of a subcommand that communicates (its table includes
// group_option_table()): --timeout SECONDS (default 120, in [1, 86400]) bounds every
// collective, so a dead or frozen peer is an error, not a hang; --pipeline-min-kib and
// --message-kib choose how large CPU all-to-alls are cut; --shared-memory sends their blocks for
// ranks on this host through /dev/shm (GroupOptions::shared_memory); --transport posts
// point-to-point transfers as messages or batched (GroupOptions::transport).
Options group_option_table();
GroupOptions group_options(const Args& args);

// `options` followed by `more`.
inline Options with(Options options, const Options& more) {
  options.insert(options.end(), more.begin(), more.end());
  return options;
}

// Options of the local launcher.
struct LaunchOptions {
  int nproc = 1;  // Ranks to start, >= 1.
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free loopback port.
};

// Starts `command` `options.nproc` times with torchrun's environment (RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT), prefixes each output line with "[rank r] ", stops
// the other ranks when one fails, and returns the first failure's exit code (0 if none).
int launch(const LaunchOptions& options, const Argv& command);
// `ulysses launch -n N [--port P] [--addr A] -- <command...>`.
const Options& launch_options();
int launch_main(const Argv& args);

// For subcommands with --nproc N: when this process is not already a rank (no RANK in the
// environment) and N > 1, re-runs `self <subcommand...> <args...>` on N local ranks and returns
// the exit code to use; otherwise returns -1 and the caller runs as a rank.
int relaunch_as_ranks(int nproc, const Argv& self, const Argv& subcommand, const Argv& args);
// How many ranks a subcommand with --nproc N runs on, known before any starts: WORLD_SIZE when
// this process is already a rank (torchrun's, or relaunch_as_ranks'), else N. Its checks of
// sizes against the ranks run with this number before relaunch_as_ranks, so a bad command line
// is refused at once instead of by every rank after they have started.
int ranks_to_run(int nproc);

// Thrown by a Runtime that hosts no process groups (the console command's launcher, loaded
// without torch: python/_ulysses_command.py) when a command asks for one in this process: the
// host then runs the command line in a runtime that has them. Not an error (no std::exception):
// run_program lets it through.
struct NeedsProcessGroups {};

}  // namespace ulysses::cli
