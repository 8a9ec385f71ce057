// The ulysses subcommands, one file each. Each takes the arguments after its name and returns
// the process exit code.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "args.h"
#include "ulysses/group.h"

namespace ulysses::cli {

using Argv = std::vector<std::string>;

// Most local ranks a subcommand starts (--nproc) or plans for (--sp).
constexpr int64_t kMaxRanks = 4096;
// Most attention heads an option accepts (--q-heads, --kv-heads): plans list every head.
constexpr int64_t kMaxHeads = 65536;

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

// The process-group options of a subcommand that communicates: --timeout SECONDS (default 120,
// in [1, 86400]) bounds every collective, so a dead or frozen peer is an error, not a hang.
GroupOptions group_options(Args& args);

// Runs `ulysses <argv...>` and returns the process exit code.
int run_cli(const Argv& argv, const Runtime& runtime);

int launch_main(const Argv& args);
int plan_main(const Argv& args);
int demo_main(const Argv& args, const Runtime& runtime);
int bench_main(const Argv& args, const Runtime& runtime);
int train_main(const Argv& args, const Runtime& runtime);
int bench_attention_main(const Argv& args, const Runtime& runtime);
int bench_a2a_main(const Argv& args, const Runtime& runtime);
int bench_layer_main(const Argv& args, const Runtime& runtime);
int bench_gemm_main(const Argv& args);

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

// For subcommands with --nproc N: when this process is not already a rank (no RANK in the
// environment) and N > 1, re-runs `self <subcommand...> <args...>` on N local ranks and returns
// the exit code to use; otherwise returns -1 and the caller runs as a rank.
int relaunch_as_ranks(int nproc, const Argv& self, const Argv& subcommand, const Argv& args);

}  // namespace ulysses::cli
