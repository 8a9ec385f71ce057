// The subcommands of tools/: their option tables (help and parser), what they do, and their
// entry points.
#include "commands.h"

namespace ulysses::cli {

std::vector<Command> cli_commands() {
  return {
      {"train", train_options(), "",
       "sequence-parallel training of a GQA transformer on local ranks (or under torchrun)",
       train_main},
      {"plan", plan_options(), "",
       "print the head (and sequence) partition of every rank and the recommended\n"
       "        Ulysses x ring split with its memory and bytes moved per layer",
       without_runtime(plan_main)},
      {"demo", demo_options(), "", "checked all-to-all round trip of a GQA layout on local ranks",
       demo_main},
      {"launch", launch_options(), "-- <command> [args...]",
       "run <command> as N local ranks (torchrun's environment, Gloo on loopback)",
       without_runtime(launch_main)},
  };
}

}  // namespace ulysses::cli
