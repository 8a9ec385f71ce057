// `ulysses bench <what>`: the benchmarks' option tables (help and parser), what they measure,
// and their entry points.
#include "bench.h"

namespace ulysses::cli {

std::vector<Command> bench_commands() {
  return {
      {"bench attention", bench_attention_options(), "",
       "fused local attention kernel vs torch's SDPA and the math reference (time, memory);\n"
       "        a causal sliding window of W keys is also timed without the window",
       bench_attention_main},
      {"bench a2a", bench_a2a_options(), "",
       "all-to-all around attention: ours vs a bare collective vs the reference chain",
       bench_a2a_main},
      {"bench layer", bench_layer_options(), "",
       "DistributedAttention forward+backward per rank: time and peak memory (per ring size)",
       bench_layer_main},
      {"bench gemm", bench_gemm_options(), "",
       "the kernel's GEMM (sgemm_ inside libtorch_cpu) vs torch.matmul on the same shapes",
       without_runtime(bench_gemm_main)},
  };
}

}  // namespace ulysses::cli
