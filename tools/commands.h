// The ulysses subcommands, one file each. Each takes the arguments after its name and returns
// the process exit code.
#pragma once

#include <string>
#include <vector>

namespace ulysses::cli {

using Argv = std::vector<std::string>;

int launch_main(const Argv& args);
int plan_main(const Argv& args);
int demo_main(const Argv& args);
int bench_main(const Argv& args);
int train_main(const Argv& args);
int bench_attention_main(const Argv& args);
int bench_a2a_main(const Argv& args);
int bench_layer_main(const Argv& args);

// Options of the local launcher.
struct LaunchOptions {
  int nproc = 1;                  // Ranks to start, >= 1.
  std::string master_addr = "127.0.0.1";
  int master_port = 0;            // 0: a free loopback port.
};

// Starts `command` `options.nproc` times with torchrun's environment (RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT), prefixes each output line with "[rank r] ", stops
// the other ranks when one fails, and returns the first failure's exit code (0 if none).
int launch(const LaunchOptions& options, const Argv& command);

// For subcommands with --nproc N: when this process is not already a rank (no RANK in the
// environment) and N > 1, re-runs this executable as `<subcommand...> <args...>` on N local
// ranks and returns the exit code to use; otherwise returns -1 and the caller runs as a rank.
int relaunch_as_ranks(int nproc, const Argv& subcommand, const Argv& args);

}  // namespace ulysses::cli
