// `ulysses bench <what>`: the benchmarks' usage and entry points.
#include "bench.h"

namespace ulysses::cli {

std::vector<Command> bench_commands() {
  return {
      {"bench attention",
       "[--seq-lens 1024,4096] [--batch 1] [--q-heads 8] [--kv-heads 2] [--head-dim 64]\n"
       "        [--dtype float32|bfloat16] [--causal 0|1|both] [--threads 2] [--repeats 3]\n"
       "        [--documents 1] [--window 0] [--memory] [--no-math] [--math-limit-gb G]\n"
       "        [--block-q 128] [--block-k 0] [--json FILE]",
       "fused local attention kernel vs torch's SDPA and the math reference (time, memory);\n"
       "        a causal sliding window of W keys is also timed without the window",
       bench_attention_main},
      {"bench a2a",
       "[--nproc 2] [--seq-lens 2048,16384] [--head-dim 64] [--layout BSHD|SBHD|BHSD]\n"
       "        [--repeats 5] [--json FILE] [--timeout 120] [--pipeline-min-kib 4096]\n"
       "        [--message-kib 4096]",
       "all-to-all around attention: ours vs a bare collective vs the reference chain",
       bench_a2a_main},
      {"bench layer",
       "[--nproc 2] [--seq-lens 2048,4096,8192] [--q-heads 8] [--kv-heads 2] [--head-dim 64]\n"
       "        [--ring 1,2] [--repeats 3] [--json FILE] [--timeout 120]\n"
       "        [--pipeline-min-kib 4096] [--message-kib 4096]",
       "DistributedAttention forward+backward per rank: time and peak memory (per ring size)",
       bench_layer_main},
      {"bench gemm", "[--shapes M,N,K,...] [--threads 1] [--repeats 20]",
       "the kernel's GEMM (sgemm_ inside libtorch_cpu) vs torch.matmul on the same shapes",
       without_runtime(bench_gemm_main)},
  };
}

}  // namespace ulysses::cli
