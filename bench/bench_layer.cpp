// `ulysses bench layer`: DistributedAttention forward + backward per rank, over S.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <iostream>
#include <numeric>
#include <thread>

#include "args.h"
#include "bench.h"
#include "bench_util.h"
#include "ulysses/all_to_all.h"
#include "ulysses/attention.h"
#include "ulysses/collective_recorder.h"
#include "ulysses/distributed_attention.h"
#include "ulysses/mesh.h"
#include "ulysses/partition.h"
#include "ulysses/ring_attention.h"

namespace ulysses::cli {

const Options& bench_layer_options() {
  // --ring: ring sizes R to compare side by side (SP = U x R with U = P / R).
  static const Options options = with(
      {value("--nproc", "2").in(1, kMaxRanks), value("--seq-lens", "2048,4096,8192").each_in(1),
       value("--q-heads", "8").in(1, kMaxHeads), value("--kv-heads", "2").in(1, kMaxHeads),
       value("--head-dim", "64").in(1), value("--ring", "1").each_in(1, kMaxRanks),
       value("--repeats", "3").in(1, 100000), flag("--projections"),
       value("--layers", "0").in(0, 1000), placeholder("--json", "FILE")},
      group_option_table());
  return options;
}

namespace {

const std::vector<std::string> kProjectedColumns{"seq_len",
                                                 "model_dim",
                                                 "layer_ms",
                                                 "layer_spread",
                                                 "sequential_ms",
                                                 "compute_ms",
                                                 "transfer_ms",
                                                 "layer_over_bound",
                                                 "sequential_over_bound",
                                                 "sequential_over_layer"};

// One attention layer with its projections (E = Hq x D, causal), fwd+bwd, four ways side by
// side: `layer` overlaps the projections with the exchanges (scatter_projected,
// gather_projected); `sequential` projects head parts first and exchanges them after
// (project_head_parts, scatter_head_parts, gather_head_parts, project_from_head_parts);
// `compute` is the same arithmetic with nothing exchanged; `transfer` the same exchanges with
// no arithmetic. The bound a perfect overlap reaches is max(compute, transfer).
bench::Record projected_layer(const Group& g, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                              int repeats) {
  const int P = g.size(), me = g.rank();
  const int64_t E = Hq * D;
  const auto heads = HeadPartition::make(Hq, Hkv, P);
  const auto seq = SequencePartition::even(S, P);
  const int64_t s = seq.length(me);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + me);
  const double init = 1.0 / std::sqrt(static_cast<double>(E));
  auto param = [&](std::vector<int64_t> shape) {
    return (at::randn(shape, gen) * init).requires_grad_();
  };
  const at::Tensor x = at::randn({1, s, E}, gen).requires_grad_();
  const std::vector<HeadProjection> in{{param({Hq * D, E}), c10::nullopt, Heads::kQuery},
                                       {param({Hkv * D, E}), c10::nullopt, Heads::kKeyValue},
                                       {param({Hkv * D, E}), c10::nullopt, Heads::kKeyValue}};
  const at::Tensor wo = param({E, Hq * D});
  const Sharding plan = agree_projection_plan(g, heads, x, in);
  const std::vector<int64_t> kv_map = heads.kv_map(me);
  // Causal attention on this rank's heads, BSHD in and out.
  auto attend = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    LocalAttentionArgs args{q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kv_map};
    args.causal = true;
    return local_attention(args).transpose(1, 2);
  };
  auto reset = [&] {
    for (const at::Tensor& t : {x, in[0].weight, in[1].weight, in[2].weight, wo})
      t.mutable_grad().reset();
  };
  auto layer = [&] {
    reset();
    const auto qkv = scatter_projected(x, in, plan, g);
    gather_projected(attend(qkv[0], qkv[1], qkv[2]), wo, plan, g).sum().backward();
  };
  auto sequential = [&] {
    reset();
    std::vector<std::vector<at::Tensor>> parts;
    for (const HeadProjection& p : in)
      parts.push_back(project_head_parts(x, p.weight, p.bias, plan.ranges(p.heads)));
    const auto qkv =
        scatter_head_parts(parts, {Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue}, plan, g);
    const at::Tensor o = attend(qkv[0], qkv[1], qkv[2]).contiguous();
    project_from_head_parts(gather_head_parts(o, Heads::kQuery, plan, g), wo,
                            plan.ranges(Heads::kQuery))
        .sum()
        .backward();
  };
  // The same GEMMs and attention on this rank's shapes, nothing exchanged.
  const int64_t hq = plan.ranges(Heads::kQuery)[me].size(),
                hkv = plan.ranges(Heads::kKeyValue)[me].size();
  const at::Tensor q0 = at::randn({1, S, hq, D}, gen).requires_grad_(),
                   k0 = at::randn({1, S, hkv, D}, gen).requires_grad_(),
                   v0 = at::randn({1, S, hkv, D}, gen).requires_grad_(),
                   o0 = at::randn({1, s, E}, gen).requires_grad_();
  auto compute = [&] {
    reset();
    at::Tensor loss = attend(q0, k0, v0).sum() + at::linear(o0, wo).sum();
    for (const HeadProjection& p : in) loss = loss + at::linear(x, p.weight).sum();
    loss.backward();
  };
  // The layer's exchanges alone (parts in, parts out: no packing), forward and backward.
  std::vector<std::vector<at::Tensor>> parts0;
  for (const HeadProjection& p : in) {
    std::vector<at::Tensor> ps;
    for (const Range& r : plan.ranges(p.heads))
      ps.push_back(at::randn({1, s, r.size(), D}, gen).requires_grad_());
    parts0.push_back(ps);
  }
  const at::Tensor y0 = at::randn({1, S, hq, D}, gen).requires_grad_();
  auto transfer = [&] {
    const auto qkv =
        scatter_head_parts(parts0, {Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue}, plan, g);
    at::Tensor loss = qkv[0].sum() + qkv[1].sum() + qkv[2].sum();
    for (const at::Tensor& part : gather_head_parts(y0, Heads::kQuery, plan, g))
      loss = loss + part.sum();
    loss.backward();
  };
  const auto t = bench::time_side_by_side(g, {layer, sequential, compute, transfer}, 1, repeats);
  const double bound = std::max(t.steps[2].median, t.steps[3].median);
  bench::Record r;
  r.add("seq_len", S).add("model_dim", E).add("q_heads", Hq).add("kv_heads", Hkv);
  r.add("head_dim", D).add("sp", P).add("causal", true);
  r.add("layer", t.steps[0]).add("sequential", t.steps[1]);
  r.add("compute", t.steps[2]).add("transfer", t.steps[3]);
  r.add("layer_over_bound", t.steps[0].median / bound);
  r.add("sequential_over_bound", t.steps[1].median / bound);
  r.add_ratio("sequential_over_layer", t.ratio(1, 0));
  return r;
}

const std::vector<std::string> kStackColumns{"seq_len",
                                             "layers",
                                             "per_call_ms",
                                             "per_call_spread",
                                             "per_step_ms",
                                             "per_step_spread",
                                             "per_call_over_step",
                                             "collectives_per_call",
                                             "collectives_per_step"};

// `layers` causal DistributedAttention layers fwd+bwd, two ways side by side: `per_call`
// agrees in every call (no StepContext); `per_step` shares one StepContext per step, so its
// calls reuse the group's armed agreement (Note [Reused agreement]). `per_call` runs on
// `other`, a second process group of the same ranks: on `g` its calls would first miss the
// armed agreement and disarm it, which neither way alone pays.
bench::Record stacked_layers(const Group& g, const Group& other, int64_t S, int64_t Hq, int64_t Hkv,
                             int64_t D, int64_t layers, int repeats) {
  AttentionOptions options;
  options.causal = true;
  std::vector<DistributedAttention> stack(layers, DistributedAttention(g, options));
  std::vector<DistributedAttention> other_stack(layers, DistributedAttention(other, options));
  const int64_t s = SequencePartition::even(S, g.size()).length(g.rank());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5 + g.rank());
  const at::Tensor q = at::randn({1, s, Hq, D}, gen).requires_grad_(),
                   k = at::randn({1, s, Hkv, D}, gen).requires_grad_(),
                   v = at::randn({1, s, Hkv, D}, gen).requires_grad_();
  int64_t collectives[2] = {0, 0};
  auto run = [&](bool shared) {
    const Group& on = shared ? g : other;
    const int64_t before = on.recorder().collectives();
    c10::optional<StepContext> step;
    if (shared) step.emplace(g);
    at::Tensor x = q;
    for (auto& layer : shared ? stack : other_stack)
      x = layer(x, k, v, {c10::nullopt, c10::nullopt, step ? &*step : nullptr});
    x.sum().backward();
    collectives[shared] = on.recorder().collectives() - before;
  };
  const auto t = bench::time_side_by_side(g, {[&] { run(false); }, [&] { run(true); }}, 1, repeats);
  bench::Record r;
  r.add("seq_len", S).add("layers", layers).add("q_heads", Hq).add("kv_heads", Hkv);
  r.add("head_dim", D).add("sp", g.size()).add("causal", true);
  r.add("per_call", t.steps[0]).add("per_step", t.steps[1]);
  r.add_ratio("per_call_over_step", t.ratio(0, 1));
  r.add("collectives_per_call", collectives[0]).add("collectives_per_step", collectives[1]);
  return r;
}

}  // namespace

int bench_layer_main(const Argv& argv, const Runtime& runtime) {
  const Args args(argv, bench_layer_options());
  const int nproc = static_cast<int>(args.integer("--nproc"));
  const auto seq_lens = args.integers("--seq-lens");
  const int64_t Hq = args.integer("--q-heads"), Hkv = args.integer("--kv-heads"),
                D = args.integer("--head-dim");
  const int repeats = static_cast<int>(args.integer("--repeats"));
  const auto rings = args.integers("--ring");
  const std::string json = args.str("--json");
  const bool projections = args.has("--projections");
  const int64_t layers = args.integer("--layers");
  const GroupOptions group_opts = group_options(args);
  const int world = ranks_to_run(nproc);
  for (int64_t R : rings) {
    if (world % R != 0)
      throw UsageError("--ring " + std::to_string(R) + " must divide the " + std::to_string(world) +
                       " ranks (--nproc)");
    try {
      HeadPartition::make(Hq, Hkv, world / R);
    } catch (const c10::Error& e) {
      throw UsageError(e.what_without_backtrace());
    }
  }
  const int code = relaunch_as_ranks(nproc, runtime.self, {"bench", "layer"}, argv);
  if (code >= 0) return code;

  Group g = runtime.join_world(group_opts);
  const int P = g.size();
  // Ranks share the machine's cores.
  at::set_num_threads(std::max<int>(1, static_cast<int>(std::thread::hardware_concurrency()) / P));
  std::vector<bench::Record> records;
  if (projections) {
    for (int64_t S : seq_lens) {
      records.push_back(projected_layer(g, S, Hq, Hkv, D, repeats));
      if (g.rank() == 0) bench::print_table({records.back()}, kProjectedColumns);
    }
    if (g.rank() == 0) {
      std::cout << "\nsummary: attention layer with projections (E = Hq x D) fwd+bwd, P=" << P
                << ", Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << ", causal, "
                << at::get_num_threads() << " threads/rank, " << bench::where_ranks_run()
                << " (ms: slowest rank, median of " << repeats
                << "; bound = max(compute, transfer))\n";
      bench::print_table(records, kProjectedColumns);
      if (!json.empty()) bench::write_json(json, records);
    }
    return 0;
  }
  if (layers > 0) {
    std::vector<int> ranks(P);
    std::iota(ranks.begin(), ranks.end(), 0);
    const Group other = runtime.split({ranks}).with_options(group_opts);
    for (int64_t S : seq_lens) {
      records.push_back(stacked_layers(g, other, S, Hq, Hkv, D, layers, repeats));
      if (g.rank() == 0) bench::print_table({records.back()}, kStackColumns);
    }
    if (g.rank() == 0) {
      std::cout << "\nsummary: " << layers << " DistributedAttention layers fwd+bwd, P=" << P
                << ", Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << ", causal, "
                << at::get_num_threads()
                << " threads/rank; per_call: an agreement round in every call, per_step: one "
                   "StepContext per step (calls reuse the group's armed agreement) (ms: slowest "
                   "rank, median of "
                << repeats << ", side by side)\n";
      bench::print_table(records, kStackColumns);
      if (!json.empty()) bench::write_json(json, records);
    }
    return 0;
  }
  AttentionOptions options;
  options.causal = true;
  // One mesh (and its process groups) per ring size, made once for every sequence length.
  std::vector<Mesh> meshes;
  for (int64_t R : rings) {
    TORCH_CHECK_VALUE(P % R == 0, "bench layer: --ring ", R, " must divide the ", P, " ranks");
    meshes.push_back(Mesh::create(g, P, runtime.split, static_cast<int>(R)));
  }
  for (int64_t S : seq_lens)
    for (size_t i = 0; i < rings.size(); ++i) {
      const int64_t R = rings[i];
      DistributedAttention attention(meshes[i].ulysses, meshes[i].ring, options);
      const RingLayout layout = RingLayout::make(S, P / R, R);
      const int64_t s = layout.shard_index(g.rank()).numel();
      LayerShape shape;
      shape.q_heads = Hq, shape.kv_heads = Hkv, shape.seq_len = S, shape.head_dim = D;
      shape.elem_bytes = 4;
      const auto plans = plan_sp_mesh(P, shape);
      int64_t planned_bytes = -1;
      for (const MeshCost& c : plans)
        if (c.ring == R) planned_bytes = c.a2a_bytes + c.ring_bytes;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(3 + g.rank());
      at::Tensor q, k, v;
      auto prepare = [&] {
        q = at::randn({1, s, Hq, D}, gen).requires_grad_();
        k = at::randn({1, s, Hkv, D}, gen).requires_grad_();
        v = at::randn({1, s, Hkv, D}, gen).requires_grad_();
      };
      auto step = [&] {
        for (at::Tensor* t : {&q, &k, &v}) t->mutable_grad().reset();
        attention(q, k, v).sum().backward();
      };
      g.barrier();
      const int64_t peak = bench::peak_extra_bytes(prepare, step);
      const bench::Stats layer = bench::time_slowest_rank(g, step, 0, repeats);
      at::Tensor peaks = g.all_gather(at::tensor({peak}, at::kLong));
      bench::Record r;
      r.add("seq_len", S).add("batch", 1).add("q_heads", Hq).add("kv_heads", Hkv);
      r.add("head_dim", D).add("sp", P).add("layout", "BSHD").add("dtype", "float32");
      r.add("ulysses", P / R).add("ring", R).add("causal", true).add("layer", layer);
      r.add("peak_bytes", peaks.max().item<int64_t>());
      r.add("planned_bytes", planned_bytes);
      r.add("planner_choice", plans.front().ring == R ? "yes" : "");
      records.push_back(r);
      if (g.rank() == 0)
        bench::print_table({r}, {"seq_len", "ulysses", "ring", "layer_ms", "layer_spread",
                                 "peak_bytes", "planned_bytes", "planner_choice"});
    }
  if (g.rank() == 0) {
    std::cout << "\nsummary: DistributedAttention fwd+bwd, P=" << P << ", Hq=" << Hq
              << " Hkv=" << Hkv << " D=" << D << ", causal, " << at::get_num_threads()
              << " threads/rank (ms: slowest rank, median of " << repeats
              << "; peak_bytes: max over ranks of peak RSS added by one step)\n";
    bench::print_table(records, {"seq_len", "ulysses", "ring", "layer_ms", "layer_spread",
                                 "peak_bytes", "planned_bytes", "planner_choice"});
    if (!json.empty()) bench::write_json(json, records);
  }
  return 0;
}

}  // namespace ulysses::cli
