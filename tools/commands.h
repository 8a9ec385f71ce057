// The ulysses subcommands of tools/, one file each. Each takes the arguments after its name
// and returns the process exit code.
#pragma once

#include <vector>

#include "plan.h"
#include "program.h"

namespace ulysses::cli {

// train, plan, demo and launch, with their usage.
std::vector<Command> cli_commands();

// Each subcommand's option table (its help and its parser).
const Options& train_options();
const Options& demo_options();

int demo_main(const Argv& args, const Runtime& runtime);
int train_main(const Argv& args, const Runtime& runtime);

}  // namespace ulysses::cli
