// `ulysses bench a2a`: Ulysses all-to-alls against the bare collective and the reference
// system's algorithm, measured side by side on the same ranks.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>

#include "args.h"
#include "bench.h"
#include "bench_util.h"
#include "reference_a2a.h"
#include "ulysses/all_to_all.h"

namespace ulysses::cli {
namespace {

struct HeadCase {
  const char* kind;
  int64_t hq, hkv;
};

// One measured case: this rank's q, k, v shards and the agreed plan.
struct A2aCase {
  const Group& g;
  Layout layout;
  int64_t S, D;
  HeadCase heads;
  int repeats;
  at::Tensor q, k, v;
  Sharding plan;
  bool gqa() const { return heads.hq != heads.hkv; }
  // Calls per timed sample: a small exchange takes well under a millisecond, where one call's
  // time is mostly the scheduler's (the ranks share the cores), so a sample runs it this many
  // times (about 8M elements of q per rank in all, at most 256 calls) and reports the time per
  // call. Computed from sizes every rank has alike, as every rank must make the same calls.
  int calls_per_sample() const {
    const int64_t q_per_rank = S * heads.hq * D / g.size();
    return static_cast<int>(std::clamp<int64_t>((int64_t{1} << 23) / q_per_rank, 1, 256));
  }
  // The steps as timed: each runs calls_per_sample() times.
  std::vector<std::function<void()>> timed(std::vector<std::function<void()>> steps) const {
    for (auto& step : steps) {
      step = [step = std::move(step), n = calls_per_sample()] {
        for (int i = 0; i < n; ++i) step();
      };
    }
    return steps;
  }
  // A side-by-side timing of `steps`, in milliseconds per call.
  bench::SideBySide time(std::vector<std::function<void()>> steps) const {
    bench::SideBySide t = bench::time_side_by_side(g, timed(std::move(steps)), 1, repeats);
    const double n = calls_per_sample();
    for (auto& samples : t.samples)
      for (double& ms : samples) ms /= n;
    for (bench::Stats& s : t.steps) s = {s.median / n, s.min / n, s.max / n};
    return t;
  }
};

A2aCase make_case(const Group& g, Layout layout, int64_t S, int64_t D, HeadCase hc, int repeats) {
  const int P = g.size();
  const auto seq = SequencePartition::even(S, P);
  const int64_t s = seq.length(g.rank());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1 + g.rank());
  auto make = [&](int64_t h) {
    std::vector<int64_t> shape{1, s, h, D};
    if (layout == Layout::kSBHD) shape = {s, 1, h, D};
    if (layout == Layout::kBHSD) shape = {1, h, s, D};
    return at::randn(shape, gen);
  };
  at::Tensor q = make(hc.hq), k = make(hc.hkv), v = make(hc.hkv);
  auto plan =
      agree_plan(g, HeadPartition::make(hc.hq, hc.hkv, P), layout,
                 {{q, Heads::kQuery, "q"}, {k, Heads::kKeyValue, "k"}, {v, Heads::kKeyValue, "v"}});
  return A2aCase{g, layout, S, D, hc, repeats, q, k, v, plan};
}

// The forward all-to-alls around attention (q, and k, v for GQA, in; o out), ours against the
// bare collective moving the same bytes into preallocated buffers.
bench::Stats time_ours_and_raw(const A2aCase& c, bench::Record& r) {
  const Group& g = c.g;
  const int P = g.size();
  auto around_attention = [&](const Group& group) {
    at::Tensor y = scatter_heads(c.q, Heads::kQuery, c.plan, group);
    if (c.gqa()) {
      scatter_heads(c.k, Heads::kKeyValue, c.plan, group);
      scatter_heads(c.v, Heads::kKeyValue, c.plan, group);
    }
    gather_heads(y, Heads::kQuery, c.plan, group);
  };
  auto ours = [&] { around_attention(g); };
  // The same with every exchange in one collective (no pipelined messages), for comparison.
  GroupOptions one_collective = g.options();
  one_collective.pipeline_min_bytes = std::numeric_limits<int64_t>::max();
  auto collective = [&, cg = g.with_options(one_collective)] { around_attention(cg); };
  // The same with blocks for ranks on this host as messages too (shared memory off; across test
  // hosts in namespaces, the same as ours).
  GroupOptions no_shared_memory = g.options();
  no_shared_memory.shared_memory = false;
  auto messages = [&, mg = g.with_options(no_shared_memory)] { around_attention(mg); };
  // The same from head parts (as project_head_parts makes them) into parts
  // (project_from_head_parts takes them): nothing to pack or unpack.
  auto parts_of = [&](const at::Tensor& x, Heads kind) {
    std::vector<at::Tensor> parts;
    for (const Range& r : c.plan.ranges(kind)) {
      parts.push_back(x.narrow(head_dim(c.layout), r.begin, r.size()).contiguous());
    }
    return parts;
  };
  const auto q_parts = parts_of(c.q, Heads::kQuery), k_parts = parts_of(c.k, Heads::kKeyValue),
             v_parts = parts_of(c.v, Heads::kKeyValue);
  auto parts = [&] {
    at::Tensor y = scatter_head_parts(q_parts, Heads::kQuery, c.plan, g);
    if (c.gqa()) {
      scatter_head_parts(k_parts, Heads::kKeyValue, c.plan, g);
      scatter_head_parts(v_parts, Heads::kKeyValue, c.plan, g);
    }
    gather_head_parts(y, Heads::kQuery, c.plan, g);
  };
  // o moves as many bytes as q in total; q's size is the same on every rank, o's is not for
  // uneven heads.
  std::vector<at::Tensor> raw_in, raw_out;
  for (const at::Tensor& t :
       c.gqa() ? std::vector<at::Tensor>{c.q, c.k, c.v, c.q} : std::vector<at::Tensor>{c.q, c.q}) {
    const int64_t n = (t.numel() + P - 1) / P * P;
    raw_in.push_back(at::randn({n}));
    raw_out.push_back(at::empty({n}, t.options()));
  }
  auto raw = [&] {
    for (size_t i = 0; i < raw_in.size(); ++i) {
      const int64_t chunk = raw_in[i].numel() / P;
      g.all_to_all(raw_out[i], raw_in[i], std::vector<int64_t>(P, chunk),
                   std::vector<int64_t>(P, chunk));
    }
  };
  const auto t = c.time({ours, raw, collective, parts, messages});
  r.add("ours", t.steps[0]).add("raw", t.steps[1]).add("collective", t.steps[2]);
  r.add("parts", t.steps[3]).add("messages", t.steps[4]);
  r.add_ratio("ours_over_raw", t.ratio(0, 1));
  r.add_ratio("collective_over_raw", t.ratio(2, 1));
  r.add_ratio("parts_over_raw", t.ratio(3, 1));
  r.add_ratio("messages_over_raw", t.ratio(4, 1));
  // What each rank sends to the others in the raw step, as a rate: across test hosts
  // (scripts/netns_hosts.sh sets LINK_RATE_BITS) also as a share of the configured link.
  double sent_bits = 0;
  for (const at::Tensor& x : raw_in) sent_bits += 8.0 * x.nbytes() * (P - 1) / P;
  // Ours moves the same bytes, so its rate is the same bits over its own time.
  const double raw_gbit = sent_bits / (t.steps[1].median * 1e-3) / 1e9;
  const double ours_gbit = sent_bits / (t.steps[0].median * 1e-3) / 1e9;
  r.add("raw_gbit_per_s", raw_gbit).add("ours_gbit_per_s", ours_gbit);
  if (const char* link = std::getenv("LINK_RATE_BITS")) {
    r.add("raw_over_link", raw_gbit * 1e9 / std::stod(link));
    r.add("ours_over_link", ours_gbit * 1e9 / std::stod(link));
  }
  return t.steps[0];
}

// The reference system's chain (where it applies), checked to give our outputs first.
void time_reference(const A2aCase& c, const bench::Stats& t_ours, bench::Record& r) {
  const Group& g = c.g;
  const int P = g.size();
  if (c.layout != Layout::kBSHD || c.S % P != 0 || (c.heads.hkv % P != 0 && c.gqa())) return;
  auto reference = [&] {
    at::Tensor y = bench::reference_scatter_heads(c.q, g);
    if (c.gqa()) {
      bench::reference_scatter_heads(c.k, g);
      bench::reference_scatter_heads(c.v, g);
    }
    bench::reference_gather_heads(y, c.heads.hq, g);
  };
  const at::Tensor o = scatter_heads(c.q, Heads::kQuery, c.plan, g);
  const bool same = bench::reference_scatter_heads(c.q, g).equal(o) &&
                    bench::reference_gather_heads(o, c.heads.hq, g).equal(c.q);
  const bench::Stats t_ref = c.time({reference}).steps[0];
  r.add("reference", t_ref);
  r.add("reference_over_ours", t_ref.median / t_ours.median);
  r.add("reference_matches", same);
}

// Q, K, V in one collective against three.
void time_fused(const A2aCase& c, bench::Record& r) {
  auto fused = [&] {
    scatter_heads({c.q, c.k, c.v}, {Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue}, c.plan,
                  c.g);
  };
  // Each output kept until all three have come, as attention needs them (and the fused exchange
  // holds them): dropped one by one, the next exchange would reuse the last's cached buffer,
  // warm in the cache, which no attention layer gets.
  auto separate = [&] {
    std::vector<at::Tensor> kept{scatter_heads(c.q, Heads::kQuery, c.plan, c.g)};
    kept.push_back(scatter_heads(c.k, Heads::kKeyValue, c.plan, c.g));
    kept.push_back(scatter_heads(c.v, Heads::kKeyValue, c.plan, c.g));
  };
  const auto t = c.time({fused, separate});
  r.add("fused", t.steps[0]).add("separate", t.steps[1]);
  r.add_ratio("separate_over_fused", t.ratio(1, 0));
}

const std::vector<std::string> kColumns{"seq_len",
                                        "heads",
                                        "q_heads",
                                        "kv_heads",
                                        "elements_per_rank",
                                        "calls_per_sample",
                                        "ours_ms",
                                        "ours_spread",
                                        "raw_ms",
                                        "ours_over_raw",
                                        "ours_over_raw_spread",
                                        "collective_over_raw",
                                        "parts_over_raw",
                                        "parts_over_raw_spread",
                                        "messages_over_raw",
                                        "messages_over_raw_spread",
                                        "raw_gbit_per_s",
                                        "raw_over_link",
                                        "ours_gbit_per_s",
                                        "ours_over_link",
                                        "reference_ms",
                                        "reference_over_ours",
                                        "reference_matches",
                                        "fused_ms",
                                        "separate_ms",
                                        "separate_over_fused",
                                        "separate_over_fused_spread"};

}  // namespace

const Options& bench_a2a_options() {
  static const Options options =
      with({value("--nproc", "2").in(1, kMaxRanks), value("--seq-lens", "2048,16384").each_in(1),
            value("--head-dim", "64").in(1), choice("--layout", "BSHD|SBHD|BHSD", "BSHD"),
            value("--repeats", "5").in(1, 100000), placeholder("--json", "FILE")},
           group_option_table());
  return options;
}

int bench_a2a_main(const Argv& argv, const Runtime& runtime) {
  const Args args(argv, bench_a2a_options());
  const int nproc = static_cast<int>(args.integer("--nproc"));
  const auto seq_lens = args.integers("--seq-lens");
  const int64_t D = args.integer("--head-dim");
  const int repeats = static_cast<int>(args.integer("--repeats"));
  const std::string layout_name = args.str("--layout");
  const std::string json = args.str("--json");
  const GroupOptions options = group_options(args);
  const int code = relaunch_as_ranks(nproc, runtime.self, {"bench", "a2a"}, argv);
  if (code >= 0) return code;

  at::set_num_threads(1);
  Group g = runtime.join_world(options);
  const int P = g.size();
  const bool lead = g.rank() == 0;
  const Layout layout = parse_layout(layout_name);
  std::vector<bench::Record> records;
  for (int64_t S : seq_lens) {
    for (const HeadCase& hc : {HeadCase{"even", 16, 16}, {"uneven", 15, 15}, {"gqa", 16, 4}}) {
      if (hc.hq < P) continue;
      const A2aCase c = make_case(g, layout, S, D, hc, repeats);
      bench::Record r;
      r.add("seq_len", S).add("batch", 1).add("q_heads", hc.hq).add("kv_heads", hc.hkv);
      r.add("head_dim", D).add("sp", P).add("layout", layout_name).add("dtype", "float32");
      r.add("heads", hc.kind).add("elements_per_rank", c.q.numel());
      r.add("calls_per_sample", c.calls_per_sample());
      time_reference(c, time_ours_and_raw(c, r), r);
      time_fused(c, r);
      records.push_back(r);
      if (lead) bench::print_table({r}, kColumns);
    }
  }
  if (!lead) return 0;
  std::cout << "\nsummary: P=" << P << ", " << layout_name << ", D=" << D << ", fp32, "
            << bench::where_ranks_run() << ", median of " << repeats
            << " (each sample: slowest rank, ms per call over calls_per_sample calls; ratios "
               "within each repeat, steps run in turn)\n";
  bench::print_table(records, kColumns);
  const bool all_referenced = std::all_of(records.begin(), records.end(), [](const auto& r) {
    return !r.text("reference_ms").empty();
  });
  if (!all_referenced) {
    std::cout << "reference: not run where its chain does not apply: it handles BSHD only, "
                 "S divisible by P, and kv heads divisible by P (or equal to the query heads)\n";
  }
  if (!json.empty()) bench::write_json(json, records);
  return 0;
}

}  // namespace ulysses::cli
