// `ulysses demo`: a checked all-to-all round trip of a GQA layout on local ranks.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <iostream>

#include "args.h"
#include "commands.h"
#include "ulysses/all_to_all.h"
#include "ulysses/partition.h"

namespace ulysses::cli {

const Options& demo_options() {
  static const Options options =
      with({value("--nproc", "4").in(1, kMaxRanks), value("--q-heads", "8").in(1, kMaxHeads),
            value("--kv-heads", "2").in(1, kMaxHeads), value("--seq-len", "1024").in(1),
            value("--head-dim", "64").in(1)},
           group_option_table());
  return options;
}

int demo_main(const Argv& argv, const Runtime& runtime) {
  const Args args(argv, demo_options());
  const int nproc = static_cast<int>(args.integer("--nproc"));
  const int64_t hq = args.integer("--q-heads");
  const int64_t hkv = args.integer("--kv-heads");
  const int64_t S = args.integer("--seq-len");
  const int64_t D = args.integer("--head-dim");
  const GroupOptions options = group_options(args);
  try {
    HeadPartition::make(hq, hkv, ranks_to_run(nproc));
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  const int code = relaunch_as_ranks(nproc, runtime.self, {"demo"}, argv);
  if (code >= 0) return code;

  at::set_num_threads(1);
  Group group = runtime.join_world(options);
  const int P = group.size(), me = group.rank();
  const auto heads = HeadPartition::make(hq, hkv, P);
  const auto seq = SequencePartition::even(S, P);
  // Every rank builds the same full tensors from one seed; each keeps its sequence shard.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  at::Tensor Q = at::randn({1, S, hq, D}, gen), K = at::randn({1, S, hkv, D}, gen);
  const Range mine = seq.range(me);
  at::Tensor q = Q.narrow(1, mine.begin, mine.size()).contiguous();
  at::Tensor k = K.narrow(1, mine.begin, mine.size()).contiguous();

  auto plan = agree_plan(group, heads, Layout::kBSHD,
                         {{q, Heads::kQuery, "q"}, {k, Heads::kKeyValue, "k"}});
  auto qk = scatter_heads({q, k}, {Heads::kQuery, Heads::kKeyValue}, plan, group);
  const Range qr = heads.q_range(me), kr = heads.kv_range(me);
  const bool scatter_ok = qk[0].equal(Q.narrow(2, qr.begin, qr.size())) &&
                          qk[1].equal(K.narrow(2, kr.begin, kr.size()));
  const bool round_trip_ok = gather_heads(qk[0], Heads::kQuery, plan, group).equal(q);
  std::cout << "q " << q.sizes() << " -> " << qk[0].sizes() << " (heads " << qr << "), k "
            << k.sizes() << " -> " << qk[1].sizes() << " (kv heads " << kr << "): scatter "
            << (scatter_ok ? "matches" : "DIFFERS from") << " the full tensor's slice, round trip "
            << (round_trip_ok ? "exact" : "WRONG") << std::endl;
  at::Tensor ok = at::full({1}, scatter_ok && round_trip_ok ? 1 : 0, at::kLong);
  group.all_reduce_sum(ok);
  const bool all_ok = ok.item<int64_t>() == P;
  if (me == 0) {
    std::cout << heads << ", " << seq << "\n" << (all_ok ? "PASS" : "FAIL") << std::endl;
  }
  return all_ok ? 0 : 1;
}

}  // namespace ulysses::cli
