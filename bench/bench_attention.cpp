// `ulysses bench attention`: the fused local attention kernel against torch's own CPU attention
// (at::scaled_dot_product_attention, GQA through enable_gqa) and the math reference.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <unistd.h>

#include <iostream>

#include "args.h"
#include "bench.h"
#include "bench_util.h"
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

// Position ids of `documents` packed documents of equal length (the last may be shorter), or
// none for one document.
c10::optional<at::Tensor> packed_positions(int64_t S, int64_t documents) {
  if (documents <= 1) return c10::nullopt;
  return at::arange(S, at::kLong) % ((S + documents - 1) / documents);
}

// One forward and backward pass of `attention` on `in`.
// The score rules of a case besides causality and documents.
struct Rules {
  int64_t window = 0;
  double softcap = 0.0;
  c10::optional<at::Tensor> sinks;  // [Hq], learnable.
};

void step(const LocalAttention& attention, Inputs& in, const std::vector<int64_t>& kv_map,
          bool causal, const c10::optional<at::Tensor>& positions, const Rules& rules) {
  for (at::Tensor* t : {&in.q, &in.k, &in.v}) t->mutable_grad().reset();
  if (rules.sinks) rules.sinks->mutable_grad().reset();
  LocalAttentionArgs args{in.q, in.k, in.v, kv_map, c10::nullopt, positions, causal, 0.0};
  args.window = rules.window;
  args.softcap = rules.softcap;
  args.sinks = rules.sinks;
  at::Tensor o = attention(args);
  (o.to(at::kFloat) * in.w).sum().backward();
}

// torch's SDPA on the same BHSD inputs: its CPU flash path (the anchor of the kernel's speed).
// Packed documents and sliding windows, which SDPA has no notion of, become a bool mask (with
// the causal rule in it: SDPA takes a mask or is_causal), built outside the timed step. Sinks
// become one more key with value 0, whose column of an additive mask holds each head's logit
// (its gradient flows through the mask). SDPA has no softcap: none is returned for one.
c10::optional<LocalAttention> sdpa_attention(const c10::optional<at::Tensor>& positions, int64_t S,
                                             bool causal, const Rules& rules) {
  if (rules.softcap > 0) return c10::nullopt;
  c10::optional<at::Tensor> mask;
  if (positions) mask = document_mask(*positions).view({1, 1, S, S});
  if (rules.window > 0) {
    at::Tensor band = at::ones({S, S}, at::kBool).triu(1 - rules.window).view({1, 1, S, S});
    mask = mask ? *mask & band : band;
  }
  if ((mask || rules.sinks) && causal) {
    at::Tensor lower = at::ones({S, S}, at::kBool).tril().view({1, 1, S, S});
    mask = mask ? *mask & lower : lower;
  }
  if (!rules.sinks) {
    return LocalAttention([mask](const LocalAttentionArgs& a) {
      return at::scaled_dot_product_attention(a.q, a.k, a.v, mask, 0.0, a.causal && !mask,
                                              c10::nullopt,
                                              /*enable_gqa=*/a.q.size(1) != a.k.size(1));
    });
  }
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const at::Tensor allowed = mask ? *mask : at::ones({1, 1, S, S}, at::kBool);
  const at::Tensor bias = at::zeros({1, 1, S, S}).masked_fill(allowed.logical_not(), -kInf);
  return LocalAttention([bias](const LocalAttentionArgs& a) {
    const int64_t B = a.q.size(0), H = a.q.size(1), Hkv = a.k.size(1);
    at::Tensor sink =
        a.sinks->to(a.q.scalar_type()).view({1, H, 1, 1}).expand({1, H, bias.size(2), 1});
    at::Tensor m = at::cat({bias.to(a.q.scalar_type()).expand({1, H, -1, -1}), sink}, -1);
    at::Tensor k = at::cat({a.k, at::zeros({B, Hkv, 1, a.k.size(3)}, a.k.options())}, 2);
    at::Tensor v = at::cat({a.v, at::zeros({B, Hkv, 1, a.v.size(3)}, a.v.options())}, 2);
    return at::scaled_dot_product_attention(a.q, k, v, m, 0.0, false, c10::nullopt,
                                            /*enable_gqa=*/H != Hkv);
  });
}

double matmul_gflops(int64_t n) {
  at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  auto stats = bench::time_ms([&] { at::matmul(a, b); }, 1, 5);
  return 2.0 * n * n * n / (stats.median * 1e6);
}

// What `bench attention` was asked for.
struct AttentionBench {
  std::vector<int64_t> seq_lens;
  int64_t B = 1, Hq = 8, Hkv = 2, D = 64;
  std::string dtype_name = "float32";
  at::ScalarType dtype = at::kFloat;
  std::vector<bool> causal_modes;
  int threads = 2, repeats = 3;
  int64_t documents = 1;  // Packed documents of equal length per sequence.
  int64_t window = 0;     // Sliding window (causal only); 0: none.
  double softcap = 0.0;   // Logit softcap; 0: none.
  bool sinks = false;     // Attention sinks (one learnable logit per head).
  bool memory = false, no_math = false;
  double math_limit_gb = 0;
  std::string json, measure_peak;  // measure_peak: internal child mode (--memory's child).
  FlashOptions blocks;
  std::vector<int64_t> kv_map;  // Query head h reads kv head h / (Hq / Hkv).
};

}  // namespace

const Options& bench_attention_options() {
  static const Options options = [] {
    const FlashOptions tiles;
    return Options{value("--seq-lens", "1024,4096").each_in(1),
                   value("--batch", "1").in(1),
                   value("--q-heads", "8").in(1, kMaxHeads),
                   value("--kv-heads", "2").in(1, kMaxHeads),
                   value("--head-dim", "64").in(1),
                   choice("--dtype", "float32|bfloat16", "float32"),
                   placeholder("--causal", "0|1|both"),  // Default: both (1 with a window).
                   value("--threads", "2").in(1, 1024),
                   value("--repeats", "3").in(1, 100000),
                   value("--documents", "1").in(1),
                   value("--window", "0").in(0),
                   value("--softcap", "0").real_in(0.0),
                   flag("--sinks"),
                   flag("--memory"),
                   flag("--no-math"),
                   placeholder("--math-limit-gb", "G")
                       .real_in(0.0),  // Default: 60 % of this machine's memory.
                   value("--block-q", std::to_string(tiles.block_q)).in(0),
                   value("--block-k", std::to_string(tiles.block_k)).in(0),
                   placeholder("--json", "FILE"),
                   hidden("--measure-peak")};
  }();
  return options;
}

namespace {

AttentionBench parse(const Argv& argv) {
  const Args args(argv, bench_attention_options());
  AttentionBench o;
  o.seq_lens = args.integers("--seq-lens");
  o.B = args.integer("--batch");
  o.Hq = args.integer("--q-heads");
  o.Hkv = args.integer("--kv-heads");
  o.D = args.integer("--head-dim");
  o.dtype_name = args.str("--dtype");
  o.window = args.integer("--window");
  o.softcap = args.real("--softcap");
  o.sinks = args.has("--sinks");
  const std::string causal = args.has("--causal") ? args.str("--causal")
                             : o.window > 0       ? "1"
                                                  : "both";
  o.threads = static_cast<int>(args.integer("--threads"));
  o.documents = args.integer("--documents");
  o.repeats = static_cast<int>(args.integer("--repeats"));
  o.memory = args.has("--memory");
  o.no_math = args.has("--no-math");
  o.math_limit_gb = args.has("--math-limit-gb")
                        ? args.real("--math-limit-gb")
                        : 0.6 * sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGE_SIZE) / 1e9;
  o.json = args.str("--json");
  o.blocks.block_q = args.integer("--block-q");
  o.blocks.block_k = args.integer("--block-k");
  o.measure_peak = args.str("--measure-peak");
  if (o.dtype_name != "float32" && o.dtype_name != "bfloat16")
    throw UsageError("--dtype must be float32 or bfloat16");
  o.dtype = o.dtype_name == "bfloat16" ? at::kBFloat16 : at::kFloat;
  if (causal == "both" || causal == "0") o.causal_modes.push_back(false);
  if (causal == "both" || causal == "1") o.causal_modes.push_back(true);
  if (o.causal_modes.empty()) throw UsageError("--causal must be 0, 1 or both");
  if (o.window > 0 && !o.causal_modes.at(0))
    throw UsageError("--window is a causal rule: give it with --causal 1");
  if (o.Hq % o.Hkv != 0) throw UsageError("--q-heads must be a multiple of --kv-heads");
  for (int64_t h = 0; h < o.Hq; ++h) o.kv_map.push_back(h / (o.Hq / o.Hkv));
  return o;
}

// The case's rules; sinks are a learnable [Hq] tensor of logits around 1.
Rules rules_of(const AttentionBench& o) {
  Rules r;
  r.window = o.window;
  r.softcap = o.softcap;
  if (o.sinks) r.sinks = (at::randn({o.Hq}) + 1.0).requires_grad_();
  return r;
}

// Peak memory one fwd+bwd of `impl` ("fused" or "math") adds, measured in a fresh process.
int64_t peak_of(const AttentionBench& o, const Runtime& runtime, const std::string& impl, int64_t S,
                bool causal) {
  std::vector<std::string> args{
      "bench",          "attention",
      "--measure-peak", impl,
      "--seq-lens",     std::to_string(S),
      "--causal",       causal ? "1" : "0",
      "--batch",        std::to_string(o.B),
      "--q-heads",      std::to_string(o.Hq),
      "--kv-heads",     std::to_string(o.Hkv),
      "--head-dim",     std::to_string(o.D),
      "--dtype",        o.dtype_name,
      "--threads",      std::to_string(o.threads),
      "--documents",    std::to_string(o.documents),
      "--window",       std::to_string(o.window),
      "--softcap",      std::to_string(o.softcap),
  };
  if (o.sinks) args.push_back("--sinks");
  return bench::peak_in_child(runtime.self, args);
}

// One case: the fused kernel (and the math reference where it fits in memory), timed side by
// side; `mm` is the machine's matmul GFLOP/s measured in the same run.
bench::Record measure(const AttentionBench& o, const Runtime& runtime, int64_t S, bool causal,
                      double mm) {
  const LocalAttention fused = [&](const LocalAttentionArgs& a) {
    return flash_attention(a, o.blocks);
  };
  Inputs in = make_inputs(o.B, o.Hq, o.Hkv, S, o.D, o.dtype);
  const auto positions = packed_positions(S, o.documents);
  const Rules rules = rules_of(o);
  const auto sdpa = sdpa_attention(positions, S, causal, rules);
  // Useful FLOPs of forward (2 matmuls) + backward (4), halved by causality, and over the
  // allowed (query, key) pairs: 1 / documents of them when packed, S*W - W(W-1)/2 of S*S/2
  // in a window of W.
  const double W = static_cast<double>(std::min(o.window, S));
  const double window_share = o.window > 0 ? (S * W - W * (W - 1) / 2) / (0.5 * S * S) : 1.0;
  const double flops = 12.0 * o.B * o.Hq * S * S * o.D * (causal ? 0.5 : 1.0) * window_share /
                       static_cast<double>(std::min(o.documents, S));
  const double math_bytes = 6.0 * 4 * o.B * o.Hq * S * S;  // ~6 live [B,H,S,S] fp32 tensors.
  const bool run_math = !o.no_math && math_bytes / 1e9 < o.math_limit_gb;
  bench::Record r;
  r.add("seq_len", S).add("batch", o.B).add("q_heads", o.Hq).add("kv_heads", o.Hkv);
  r.add("head_dim", o.D).add("dtype", o.dtype_name).add("causal", causal);
  r.add("documents", o.documents).add("window", o.window);
  r.add("softcap", o.softcap).add("sinks", o.sinks);
  {  // The kernel the library's rule picks for this case (Note [Local attention by case]).
    LocalAttentionArgs a{in.q, in.k, in.v, o.kv_map, c10::nullopt, positions, causal, 0.0};
    a.window = rules.window, a.softcap = rules.softcap, a.sinks = rules.sinks;
    r.add("auto", to_string(choose_local_kernel(a, LocalKernel::kAuto)));
  }
  const auto f =
      bench::time_ms([&] { step(fused, in, o.kv_map, causal, positions, rules); }, 1, o.repeats);
  r.add("fused", f);
  if (o.window > 0) {  // The same kernel without the window, side by side: tiles skipped.
    Rules no_window = rules;
    no_window.window = 0;
    const auto full = bench::time_ms(
        [&] { step(fused, in, o.kv_map, causal, positions, no_window); }, 1, o.repeats);
    r.add("fused_no_window", full).add("no_window_over_window", full.median / f.median);
  }
  if (o.dtype != at::kFloat) {  // The kernel on the same values in fp32: what bf16 buys.
    Inputs in32 = in;
    for (at::Tensor* t : {&in32.q, &in32.k, &in32.v}) {
      *t = t->detach().to(at::kFloat).requires_grad_();
    }
    const auto t = bench::time_ms([&] { step(fused, in32, o.kv_map, causal, positions, rules); }, 1,
                                  o.repeats);
    r.add("fused_fp32", t).add("fp32_over_fused", t.median / f.median);
  }
  if (sdpa) {  // (None for a softcap, which SDPA has no equivalent of.)
    const auto t =
        bench::time_ms([&] { step(*sdpa, in, o.kv_map, causal, positions, rules); }, 1, o.repeats);
    r.add("sdpa", t).add("sdpa_over_fused", t.median / f.median);
  }
  if (run_math) {
    const auto m = bench::time_ms(
        [&] { step(math_attention, in, o.kv_map, causal, positions, rules); }, 1, o.repeats);
    r.add("math", m).add("math_over_fused", m.median / f.median);
  }
  const double gflops = flops / (f.median * 1e6);
  r.add("fused_gflops", gflops).add("matmul_gflops", mm);
  r.add("fused_pct_of_matmul", 100.0 * gflops / mm);
  if (o.memory) {
    const int64_t fp = peak_of(o, runtime, "fused", S, causal);
    r.add("fused_peak_bytes", fp);
    if (sdpa) r.add("sdpa_peak_bytes", peak_of(o, runtime, "sdpa", S, causal));
    if (run_math) {
      const int64_t mp = peak_of(o, runtime, "math", S, causal);
      r.add("math_peak_bytes", mp);
      if (mp > 0) r.add("fused_over_math_peak", static_cast<double>(fp) / mp);
    }
  }
  return r;
}

// Prints the causal speed-up wherever a full and a causal case of one length ran.
void print_causal_speedups(const std::vector<bench::Record>& records) {
  for (size_t i = 0; i + 1 < records.size(); ++i) {
    if (records[i].text("seq_len") == records[i + 1].text("seq_len") &&
        records[i].text("causal") == "false" && records[i + 1].text("causal") == "true") {
      std::cout << "causal speedup at S=" << records[i].text("seq_len") << ": "
                << std::stod(records[i].text("fused_ms")) /
                       std::stod(records[i + 1].text("fused_ms"))
                << "x\n";
    }
  }
}

const std::vector<std::string> kColumns{"seq_len",
                                        "causal",
                                        "window",
                                        "softcap",
                                        "sinks",
                                        "auto",
                                        "fused_ms",
                                        "fused_spread",
                                        "no_window_over_window",
                                        "fused_fp32_ms",
                                        "fp32_over_fused",
                                        "sdpa_ms",
                                        "sdpa_over_fused",
                                        "math_ms",
                                        "math_over_fused",
                                        "fused_gflops",
                                        "fused_pct_of_matmul",
                                        "fused_peak_bytes",
                                        "sdpa_peak_bytes",
                                        "math_peak_bytes",
                                        "fused_over_math_peak"};

}  // namespace

int bench_attention_main(const Argv& argv, const Runtime& runtime) {
  const AttentionBench o = parse(argv);
  at::set_num_threads(o.threads);
  if (!o.measure_peak.empty()) {  // Child of --memory: one case, one implementation.
    const int64_t S = o.seq_lens.at(0);
    const bool causal = o.causal_modes.at(0);
    const auto positions = packed_positions(S, o.documents);
    const Rules rules = rules_of(o);
    Inputs in;
    LocalAttention impl;
    const int64_t bytes = bench::peak_extra_bytes(
        [&] {
          in = make_inputs(o.B, o.Hq, o.Hkv, S, o.D, o.dtype);
          impl = o.measure_peak == "math" ? LocalAttention(math_attention)
                 : o.measure_peak == "sdpa"
                     ? sdpa_attention(positions, S, causal, rules).value()
                     : [&](const LocalAttentionArgs& a) { return flash_attention(a, o.blocks); };
        },
        [&] { step(impl, in, o.kv_map, causal, positions, rules); });
    std::cout << "peak_extra_bytes: " << bytes << std::endl;
    return 0;
  }
  const double mm = matmul_gflops(2048);
  std::cout << "kernel GEMM: sgemm_ from " << bench::gemm_library() << "; fused kernel built for "
            << flash_attention_isa() << "\n"
            << "at::matmul fp32 2048x2048, " << o.threads << " threads: " << mm << " GFLOP/s\n";
  // A modern x86 core does >= 50 fp32 GFLOP/s; far less means a mis-detected BLAS kernel, and
  // percentages of it would overstate the fused kernel.
  if (mm < 20.0 * o.threads) {
    std::cout << "warning: at::matmul is implausibly slow (" << mm << " GFLOP/s on " << o.threads
              << " threads); the % of matmul columns are not meaningful\n";
  }
  std::vector<bench::Record> records;
  for (int64_t S : o.seq_lens) {
    for (bool causal : o.causal_modes) {
      records.push_back(measure(o, runtime, S, causal, mm));
      bench::print_table({records.back()}, kColumns);
    }
  }
  std::cout << "\nsummary (B=" << o.B << " Hq=" << o.Hq << " Hkv=" << o.Hkv << " D=" << o.D << " "
            << o.dtype_name << ", " << o.documents << " document(s) per sequence, " << o.threads
            << " threads, median of " << o.repeats << ")\n";
  bench::print_table(records, kColumns);
  print_causal_speedups(records);
  if (!o.json.empty()) bench::write_json(o.json, records);
  return 0;
}

}  // namespace ulysses::cli
