// The `ulysses` command-line tool: dispatches to one subcommand per file, prints help.
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <iostream>

#include "args.h"
#include "commands.h"

namespace ulysses::cli {
namespace {

// One subcommand's usage: its name, its options (with defaults) and what it does.
struct Usage {
  const char* name;
  const char* synopsis;
  const char* about;
};

const Usage kUsages[] = {
    {"train",
     "[--nproc 4] [--sp P] [--dp D] [--ring R] [--seq-len 256] [--batch 8] [--steps 400]\n"
     "        [--dim 128] [--layers 2] [--q-heads 8] [--kv-heads 2] [--ffn-dim 0] [--lr 5e-3]\n"
     "        [--warmup 50] [--lr-decay-steps STEPS] [--weight-decay 0.01] [--clip 1.0]\n"
     "        [--pairs 16] [--shuffle] [--data FILE] [--eval-every 100] [--eval-sequences 64]\n"
     "        [--log-every 25] [--seed 0] [--check] [--save DIR] [--resume DIR] [--timeout 120]",
     "sequence-parallel training of a GQA transformer on local ranks (or under torchrun)"},
    {"plan",
     "--q-heads N [--kv-heads N] --sp P [--seq-len S] [--head-dim 128] [--batch 1]\n"
     "        [--elem-bytes 2] [--json]",
     "print the head (and sequence) partition of every rank and the recommended\n"
     "        Ulysses x ring split with its memory and bytes moved per layer"},
    {"demo",
     "[--nproc 4] [--q-heads 8] [--kv-heads 2] [--seq-len 1024] [--head-dim 64]\n"
     "        [--timeout 120]",
     "checked all-to-all round trip of a GQA layout on local ranks"},
    {"bench attention",
     "[--seq-lens 1024,4096] [--batch 1] [--q-heads 8] [--kv-heads 2] [--head-dim 64]\n"
     "        [--dtype float32|bfloat16] [--causal 0|1|both] [--threads 2] [--repeats 3]\n"
     "        [--documents 1] [--memory] [--no-math] [--math-limit-gb G] [--block-q 128]\n"
     "        [--block-k 0]\n"
     "        [--json FILE]",
     "fused local attention kernel vs torch's SDPA and the math reference (time, memory)"},
    {"bench a2a",
     "[--nproc 2] [--seq-lens 2048,16384] [--head-dim 64] [--layout BSHD|SBHD|BHSD]\n"
     "        [--repeats 5] [--json FILE] [--timeout 120] [--pipeline-min-kib 4096]\n"
     "        [--message-kib 4096]",
     "all-to-all around attention: ours vs a bare collective vs the reference chain"},
    {"bench layer",
     "[--nproc 2] [--seq-lens 2048,4096,8192] [--q-heads 8] [--kv-heads 2] [--head-dim 64]\n"
     "        [--ring 1,2] [--repeats 3] [--json FILE] [--timeout 120]",
     "DistributedAttention forward+backward per rank: time and peak memory (per ring size)"},
    {"bench gemm", "[--shapes M,N,K,...] [--threads 1] [--repeats 20]",
     "the kernel's GEMM (sgemm_ inside libtorch_cpu) vs torch.matmul on the same shapes"},
    {"launch", "-n N [--port 0] [--addr 127.0.0.1] -- <command> [args...]",
     "run <command> as N local ranks (torchrun's environment, Gloo on loopback)"},
};

// Prints the usage of every command whose name starts with `prefix` ("" for all).
void print_usage(std::ostream& os, const std::string& prefix) {
  if (prefix.empty()) {
    os << "usage: ulysses <command> [options]    (ulysses <command> --help, ulysses --version)\n\n"
          "commands (--timeout SECONDS bounds every collective of those that communicate;\n"
          "--pipeline-min-kib K and --message-kib M: CPU all-to-alls sending >= K KiB per rank\n"
          "go as pipelined messages of M KiB; defaults 4096 and 4096):\n";
  }
  for (const Usage& u : kUsages) {
    if (std::string(u.name).rfind(prefix, 0) != 0) continue;
    os << (prefix.empty() ? "  " : "usage: ") << "ulysses " << u.name << " " << u.synopsis << "\n"
       << (prefix.empty() ? "    " : "") << u.about << "\n";
  }
}

bool asks_for_help(const Argv& args) {
  for (const std::string& a : args) {
    if (a == "--") return false;  // What follows belongs to launch's command.
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

}  // namespace

GroupOptions group_options(Args& args) {
  GroupOptions options;
  options.timeout = std::chrono::seconds(args.integer("--timeout", 120, 1, 86400));
  constexpr int64_t kKiB = 1024, kMostKiB = int64_t{1} << 40;
  options.pipeline_min_bytes =
      kKiB * args.integer("--pipeline-min-kib", options.pipeline_min_bytes / kKiB, 0, kMostKiB);
  options.message_bytes =
      kKiB * args.integer("--message-kib", options.message_bytes / kKiB, 1, kMostKiB);
  return options;
}

int run_cli(const Argv& argv, const Runtime& runtime) {
  if (argv.empty() || argv[0] == "--help" || argv[0] == "-h") {
    print_usage(argv.empty() ? std::cerr : std::cout, "");
    return argv.empty() ? 2 : 0;
  }
  if (argv[0] == "--version") {
    std::cout << "ulysses " << ULYSSES_VERSION << " (torch " << TORCH_VERSION << ")\n";
    return 0;
  }
  const std::string command = argv[0];
  const Argv args(argv.begin() + 1, argv.end());
  // The name users type, for messages: "train", or "bench a2a".
  std::string name = command;
  if (command == "bench" && !args.empty() && args[0].rfind("-", 0) != 0) name += " " + args[0];
  if (asks_for_help(args)) {
    print_usage(std::cout, name);
    return 0;
  }
  try {
    if (command == "plan") return plan_main(args);
    if (command == "demo") return demo_main(args, runtime);
    if (command == "train") return train_main(args, runtime);
    if (command == "launch") return launch_main(args);
    if (command == "bench") return bench_main(args, runtime);
    std::cerr << "ulysses: unknown command '" << shown(command) << "' (see 'ulysses --help')\n";
    return 2;
  } catch (const UsageError& e) {
    std::cerr << "ulysses " << name << ": " << e.what() << " (see 'ulysses " << name
              << " --help')\n";
    return 2;
  } catch (const c10::Error& e) {
    // Library messages start with their op ("train: ..."); do not say the command twice.
    std::string what = e.what_without_backtrace();
    if (what.rfind(command + ": ", 0) == 0) what.erase(0, command.size() + 2);
    std::cerr << "ulysses " << name << ": error: " << what << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ulysses " << name << ": error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace ulysses::cli
