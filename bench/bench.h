// The benchmark drivers of `ulysses bench <what>`, one file each.
#pragma once

#include <vector>

#include "program.h"

namespace ulysses::cli {

// bench attention, bench a2a, bench layer and bench gemm, with their usage.
std::vector<Command> bench_commands();

int bench_attention_main(const Argv& args, const Runtime& runtime);
int bench_a2a_main(const Argv& args, const Runtime& runtime);
int bench_layer_main(const Argv& args, const Runtime& runtime);
int bench_gemm_main(const Argv& args);

}  // namespace ulysses::cli
