// The benchmark drivers of `ulysses bench <what>`, one file each.
#pragma once

#include <vector>

#include "program.h"

namespace ulysses::cli {

// bench attention, bench a2a, bench layer and bench gemm, with their usage.
std::vector<Command> bench_commands();

// Each benchmark's option table (its help and its parser).
const Options& bench_attention_options();
const Options& bench_a2a_options();
const Options& bench_layer_options();
const Options& bench_gemm_options();

int bench_attention_main(const Argv& args, const Runtime& runtime);
int bench_a2a_main(const Argv& args, const Runtime& runtime);
int bench_layer_main(const Argv& args, const Runtime& runtime);
int bench_gemm_main(const Argv& args);

}  // namespace ulysses::cli
