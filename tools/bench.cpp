// `ulysses bench <what>`: dispatches to the benchmark drivers in bench/.
#include "args.h"
#include "commands.h"

namespace ulysses::cli {

int bench_main(const Argv& args, const Runtime& runtime) {
  if (args.empty()) throw UsageError("say what to measure: attention, a2a, layer or gemm");
  const Argv rest(args.begin() + 1, args.end());
  if (args[0] == "attention") return bench_attention_main(rest, runtime);
  if (args[0] == "a2a") return bench_a2a_main(rest, runtime);
  if (args[0] == "layer") return bench_layer_main(rest, runtime);
  if (args[0] == "gemm") return bench_gemm_main(rest);
  throw UsageError("unknown benchmark '" + args[0] + "'; choose attention, a2a, layer or gemm");
}

}  // namespace ulysses::cli
