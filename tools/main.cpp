// The `ulysses` command-line tool: dispatches to one subcommand per file.
#include <c10/util/Exception.h>

#include <iostream>

#include "args.h"
#include "commands.h"

namespace {

const char* kUsage = R"(usage: ulysses <command> [options]

commands:
  plan    --q-heads N [--kv-heads M] --sp P [--seq-len S] [--json]
          print the head (and sequence) partition of every rank
  demo    [--nproc 4] [--q-heads 8] [--kv-heads 2] [--seq-len 1024] [--head-dim 64]
          checked all-to-all round trip of a GQA layout on local ranks
  launch  -n N [--port P] -- <command> [args...]
          run <command> as N local ranks (torchrun's environment, Gloo on loopback)
)";

}  // namespace

int main(int argc, char** argv) {
  using namespace ulysses::cli;
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  const Argv args(argv + 2, argv + argc);
  try {
    if (command == "plan") return plan_main(args);
    if (command == "demo") return demo_main(args);
    if (command == "launch") return launch_main(args);
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
