// `ulysses bench attention`: the fused local attention kernel against the math reference.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <unistd.h>

#include <iostream>

#include "args.h"
#include "bench_util.h"
#include "commands.h"
#include "ulysses/flash_attention.h"

namespace ulysses::cli {
namespace {

struct Inputs {
  at::Tensor q, k, v, w;
};

Inputs make_inputs(int64_t B, int64_t Hq, int64_t Hkv, int64_t S, int64_t D, at::ScalarType t) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return {at::randn({B, Hq, S, D}, gen).to(t).requires_grad_(),
          at::randn({B, Hkv, S, D}, gen).to(t).requires_grad_(),
          at::randn({B, Hkv, S, D}, gen).to(t).requires_grad_(), at::randn({B, Hq, S, D}, gen)};
}

// One forward and backward pass of `attention` on `in`.
void step(const LocalAttention& attention, Inputs& in, const std::vector<int64_t>& kv_map,
          bool causal) {
  for (at::Tensor* t : {&in.q, &in.k, &in.v}) t->mutable_grad().reset();
  at::Tensor o = attention({in.q, in.k, in.v, kv_map, c10::nullopt, c10::nullopt, causal, 0.0});
  (o.to(at::kFloat) * in.w).sum().backward();
}

double matmul_gflops(int64_t n) {
  at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  auto stats = bench::time_ms([&] { at::matmul(a, b); }, 1, 5);
  return 2.0 * n * n * n / (stats.median * 1e6);
}

}  // namespace

int bench_attention_main(const Argv& argv, const Runtime& runtime) {
  Args args(argv, {"--memory", "--no-math"});
  const auto seq_lens = args.integers("--seq-lens", "1024,4096", 1);
  const int64_t B = args.integer("--batch", 1, 1), Hq = args.integer("--q-heads", 8, 1, kMaxHeads),
                Hkv = args.integer("--kv-heads", 2, 1, kMaxHeads),
                D = args.integer("--head-dim", 64, 1);
  const std::string dtype_name = args.str("--dtype", "float32");
  const std::string causal_arg = args.str("--causal", "both");
  const int threads = static_cast<int>(args.integer("--threads", 2, 1, 1024));
  const int repeats = static_cast<int>(args.integer("--repeats", 3, 1, 100000));
  const bool memory = args.has("--memory");
  const bool no_math = args.has("--no-math");
  const double math_limit_gb =
      args.real("--math-limit-gb", 0.6 * sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGE_SIZE) / 1e9);
  const std::string json = args.str("--json", "");
  FlashOptions blocks;
  blocks.block_q = args.integer("--block-q", blocks.block_q, 1);
  blocks.block_k = args.integer("--block-k", blocks.block_k, 0);
  const std::string measure_peak = args.str("--measure-peak", "");  // Internal: child mode.
  args.finish();
  const at::ScalarType dtype = dtype_name == "bfloat16" ? at::kBFloat16 : at::kFloat;
  if (dtype_name != "float32" && dtype_name != "bfloat16")
    throw UsageError("--dtype must be float32 or bfloat16");
  std::vector<bool> causal_modes;
  if (causal_arg == "both" || causal_arg == "0") causal_modes.push_back(false);
  if (causal_arg == "both" || causal_arg == "1") causal_modes.push_back(true);
  if (causal_modes.empty()) throw UsageError("--causal must be 0, 1 or both");

  at::set_num_threads(threads);
  std::vector<int64_t> kv_map;
  for (int64_t h = 0; h < Hq; ++h) kv_map.push_back(h / (Hq / Hkv));
  const LocalAttention fused = [blocks](const LocalAttentionArgs& a) {
    return flash_attention(a, blocks);
  };
  const LocalAttention math = math_attention;
  if (!measure_peak.empty()) {  // Child of --memory: one case, one implementation.
    Inputs in;
    const int64_t bytes = bench::peak_extra_bytes(
        [&] { in = make_inputs(B, Hq, Hkv, seq_lens.at(0), D, dtype); },
        [&] { step(measure_peak == "math" ? math : fused, in, kv_map, causal_modes.at(0)); });
    std::cout << "peak_extra_bytes: " << bytes << std::endl;
    return 0;
  }
  const double mm = matmul_gflops(2048);
  std::cout << "kernel GEMM: sgemm_ from " << bench::gemm_library() << "\n"
            << "at::matmul fp32 2048x2048, " << threads << " threads: " << mm << " GFLOP/s\n";
  // A modern x86 core does >= 50 fp32 GFLOP/s; far less means a mis-detected BLAS kernel, and
  // percentages of it would overstate the fused kernel.
  if (mm < 20.0 * threads) {
    std::cout << "warning: at::matmul is implausibly slow (" << mm << " GFLOP/s on " << threads
              << " threads); the % of matmul columns are not meaningful\n";
  }

  std::vector<bench::Record> records;
  for (int64_t S : seq_lens) {
    for (bool causal : causal_modes) {
      Inputs in = make_inputs(B, Hq, Hkv, S, D, dtype);
      // Useful FLOPs of forward (2 matmuls) + backward (4), halved by causality.
      const double flops = 12.0 * B * Hq * S * S * D * (causal ? 0.5 : 1.0);
      const double math_bytes = 6.0 * 4 * B * Hq * S * S;  // ~6 live [B,H,S,S] fp32 tensors.
      const bool run_math = !no_math && math_bytes / 1e9 < math_limit_gb;
      auto f = bench::time_ms([&] { step(fused, in, kv_map, causal); }, 1, repeats);
      bench::Stats m;
      if (run_math) m = bench::time_ms([&] { step(math, in, kv_map, causal); }, 1, repeats);
      bench::Record r;
      r.add("seq_len", S).add("batch", B).add("q_heads", Hq).add("kv_heads", Hkv);
      r.add("head_dim", D).add("dtype", dtype_name).add("causal", causal);
      r.add("fused", f);
      if (run_math) {
        r.add("math", m);
        r.add("math_over_fused", m.median / f.median);
      }
      const double gflops = flops / (f.median * 1e6);
      r.add("fused_gflops", gflops)
          .add("matmul_gflops", mm)
          .add("fused_pct_of_matmul", 100.0 * gflops / mm);
      if (memory) {
        auto peak = [&](const std::string& impl) {
          return bench::peak_in_child(
              runtime.self,
              {"bench",      "attention",         "--measure-peak", impl,
               "--seq-lens", std::to_string(S),   "--causal",       causal ? "1" : "0",
               "--batch",    std::to_string(B),   "--q-heads",      std::to_string(Hq),
               "--kv-heads", std::to_string(Hkv), "--head-dim",     std::to_string(D),
               "--dtype",    dtype_name,          "--threads",      std::to_string(threads)});
        };
        const int64_t fp = peak("fused");
        r.add("fused_peak_bytes", fp);
        if (run_math) {
          const int64_t mp = peak("math");
          r.add("math_peak_bytes", mp);
          if (mp > 0) r.add("fused_over_math_peak", static_cast<double>(fp) / mp);
        }
      }
      records.push_back(r);
      bench::print_table(
          {r}, {"seq_len", "causal", "fused_ms", "fused_spread", "math_ms", "math_spread",
                "math_over_fused", "fused_gflops", "fused_pct_of_matmul", "fused_peak_bytes",
                "math_peak_bytes", "fused_over_math_peak"});
    }
  }
  std::cout << "\nsummary (B=" << B << " Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " "
            << dtype_name << ", " << threads << " threads, median of " << repeats << ")\n";
  bench::print_table(records,
                     {"seq_len", "causal", "fused_ms", "fused_spread", "math_ms", "math_spread",
                      "math_over_fused", "fused_gflops", "fused_pct_of_matmul", "fused_peak_bytes",
                      "math_peak_bytes", "fused_over_math_peak"});
  for (size_t i = 0; i + 1 < records.size(); ++i) {
    if (records[i].text("seq_len") == records[i + 1].text("seq_len") &&
        records[i].text("causal") == "false" && records[i + 1].text("causal") == "true") {
      std::cout << "causal speedup at S=" << records[i].text("seq_len") << ": "
                << std::stod(records[i].text("fused_ms")) /
                       std::stod(records[i + 1].text("fused_ms"))
                << "x\n";
    }
  }
  if (!json.empty()) bench::write_json(json, records);
  return 0;
}

}  // namespace ulysses::cli
