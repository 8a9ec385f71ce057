// `ulysses plan`: the pure planner's command. Apart from the other commands (commands.h), so
// that the planner's module (bindings/plan_module.cpp) is built from c10 and the plan floor
// alone: answering `ulysses plan` loads neither torch nor libtorch.
#pragma once

#include <string>
#include <vector>

#include "args.h"

namespace ulysses::cli {

const Options& plan_options();
int plan_main(const Argv& args);

}  // namespace ulysses::cli
