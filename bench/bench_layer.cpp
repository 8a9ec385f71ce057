// `ulysses bench layer`: DistributedAttention forward + backward per rank, over S.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <iostream>
#include <thread>

#include "args.h"
#include "bench.h"
#include "bench_util.h"
#include "ulysses/distributed_attention.h"
#include "ulysses/ring_attention.h"

namespace ulysses::cli {

const Options& bench_layer_options() {
  // --ring: ring sizes R to compare side by side (SP = U x R with U = P / R).
  static const Options options =
      with({value("--nproc", "2"), value("--seq-lens", "2048,4096,8192"), value("--q-heads", "8"),
            value("--kv-heads", "2"), value("--head-dim", "64"), value("--ring", "1"),
            value("--repeats", "3"), placeholder("--json", "FILE")},
           group_option_table());
  return options;
}

int bench_layer_main(const Argv& argv, const Runtime& runtime) {
  const Args args(argv, bench_layer_options());
  const int nproc = static_cast<int>(args.integer("--nproc", 1, kMaxRanks));
  const auto seq_lens = args.integers("--seq-lens", 1);
  const int64_t Hq = args.integer("--q-heads", 1, kMaxHeads),
                Hkv = args.integer("--kv-heads", 1, kMaxHeads), D = args.integer("--head-dim", 1);
  const int repeats = static_cast<int>(args.integer("--repeats", 1, 100000));
  const auto rings = args.integers("--ring", 1, kMaxRanks);
  const std::string json = args.str("--json");
  const GroupOptions group_opts = group_options(args);
  const int code = relaunch_as_ranks(nproc, runtime.self, {"bench", "layer"}, argv);
  if (code >= 0) return code;

  Group g = runtime.join_world(group_opts);
  const int P = g.size();
  // Ranks share the machine's cores.
  at::set_num_threads(std::max<int>(1, static_cast<int>(std::thread::hardware_concurrency()) / P));
  AttentionOptions options;
  options.causal = true;
  std::vector<bench::Record> records;
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
