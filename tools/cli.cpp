// The `ulysses` command-line tool: dispatches to one subcommand per file.
#include <c10/util/Exception.h>

#include <iostream>

#include "args.h"
#include "commands.h"

namespace {

const char* kUsage = R"(usage: ulysses <command> [options]

commands:
  train   [--nproc 4] [--sp P] [--dp D] [--seq-len 256] [--batch 8] [--steps 400]
          [--dim 128] [--layers 2] [--q-heads 8] [--kv-heads 2] [--ffn-dim 0] [--lr 5e-3]
          [--warmup 50] [--lr-decay-steps STEPS] [--weight-decay 0.01] [--clip 1.0]
          [--pairs 16] [--shuffle] [--data FILE] [--eval-every 100] [--eval-sequences 64]
          [--log-every 25] [--seed 0] [--check] [--save DIR] [--resume DIR]
          sequence-parallel training of a GQA transformer on local ranks
  plan    --q-heads N [--kv-heads M] --sp P [--seq-len S] [--json]
          print the head (and sequence) partition of every rank
  demo    [--nproc 4] [--q-heads 8] [--kv-heads 2] [--seq-len 1024] [--head-dim 64]
          checked all-to-all round trip of a GQA layout on local ranks
  bench attention [--seq-lens 1024,4096] [--batch 1] [--q-heads 8] [--kv-heads 2]
          [--head-dim 64] [--dtype float32|bfloat16] [--causal 0|1|both] [--threads 2]
          [--repeats 3] [--memory] [--no-math] [--block-q 64] [--block-k 0] [--json FILE]
          fused local attention kernel vs the math reference (time, GFLOP/s, peak memory)
  bench gemm [--shapes M,N,K,...] [--threads 1] [--repeats 20]
          the kernel's GEMM (sgemm_ inside libtorch_cpu) vs torch.matmul on the same shapes
  launch  -n N [--port P] -- <command> [args...]
          run <command> as N local ranks (torchrun's environment, Gloo on loopback)
)";

}  // namespace

namespace ulysses::cli {

int run_cli(const Argv& argv, const Runtime& runtime) {
  if (argv.empty() || argv[0] == "--help" || argv[0] == "-h") {
    std::cout << kUsage;
    return argv.empty() ? 2 : 0;
  }
  const std::string command = argv[0];
  const Argv args(argv.begin() + 1, argv.end());
  try {
    if (command == "plan") return plan_main(args);
    if (command == "demo") return demo_main(args, runtime);
    if (command == "train") return train_main(args, runtime);
    if (command == "launch") return launch_main(args);
    if (command == "bench") return bench_main(args, runtime);
    std::cerr << "ulysses: unknown command '" << command << "'\n" << kUsage;
    return 2;
  } catch (const UsageError& e) {
    std::cerr << "ulysses " << command << ": " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "ulysses " << command << ": error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ulysses " << command << ": error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace ulysses::cli
