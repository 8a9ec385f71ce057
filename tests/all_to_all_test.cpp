#include "ulysses/all_to_all.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <sstream>

#include "testing.h"
#include "transport/agreement.h"
#include "transport/group_runtime.h"
#include "ulysses/attention.h"
#include "ulysses/collective_recorder.h"
#include "ulysses/mask.h"

namespace ulysses {
namespace {

using testing::expect_ranks_fail_alike;
using testing::expect_ranks_succeed;
using testing::rel_error;
using testing::run_ranks;
using testing::run_with_absent_peer;
using testing::where;

using testing::seeded_randn;

using testing::full_shape;

struct Case {
  int P;
  int64_t hq, hkv, S;
  Layout layout;
  int64_t B = 2, D = 8, Dv = 8;
  // > 0: every exchange goes as pipelined messages of about this many bytes (0: one collective).
  int64_t message_bytes = 0;
  // Blocks between these ranks (all on this host) go through shared memory: with message_bytes
  // > 0 instead of messages, else instead of the collective (Note [Flag handshake]).
  bool shared_memory = false;
  // > 0, with shared_memory and no message_bytes: handed over with flags through windows of
  // about this many bytes (GroupOptions::message_bytes), many rounds of them.
  int64_t window_bytes = 0;
};

// `g` with the case's exchange options. Every call of every rank issues the same collectives
// (pipelined through shared memory: the links' set-up).
Group with_exchange(const Group& g, const Case& c) {
  GroupOptions options = g.options();
  options.shared_memory = c.shared_memory;
  if (c.message_bytes > 0) {
    options.pipeline_min_bytes = 0;
    options.message_bytes = c.message_bytes;
  } else {
    options.pipeline_min_bytes = std::numeric_limits<int64_t>::max();
    if (c.window_bytes > 0) options.message_bytes = c.window_bytes;
  }
  const Group h = g.with_options(options);
  // Pipelined through shared memory: as when some rank is on another host (else the ranks, all
  // on this one, hand over with flags).
  if (c.message_bytes > 0 && c.shared_memory) h.runtime().links(h).stop_flag_exchanges();
  return h;
}

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "P" << c.P << "_q" << c.hq << "_kv" << c.hkv << "_S" << c.S << "_" << to_string(c.layout)
     << "_B" << c.B << "_D" << c.D << "_Dv" << c.Dv;
  if (c.message_bytes > 0) os << (c.shared_memory ? "_shm" : "_messages") << c.message_bytes;
  if (c.message_bytes == 0 && c.shared_memory) os << "_flags";
  if (c.window_bytes > 0) os << c.window_bytes;
  return os.str();
}
std::string case_name(const ::testing::TestParamInfo<Case>& info) { return describe(info.param); }
void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

class AllToAll : public ::testing::TestWithParam<Case> {};

// gather(scatter(x)) == x bit for bit for query heads; kv heads come back multiplied by the
// number of ranks holding them (gather sums replicas, as backward needs).
TEST_P(AllToAll, RoundTrip) {
  const Case c = GetParam();
  expect_ranks_succeed(c.P, [&](Group& world) {
    const Group g = with_exchange(world, c);
    auto part = HeadPartition::make(c.hq, c.hkv, c.P);
    auto seq = SequencePartition::even(c.S, c.P);
    const int64_t sdim = seq_dim(c.layout), hdim = head_dim(c.layout);
    at::Tensor Q = seeded_randn(full_shape(c.layout, c.B, c.S, c.hq, c.D), 1);
    at::Tensor K = seeded_randn(full_shape(c.layout, c.B, c.S, c.hkv, c.D), 2);
    const Range mine = seq.range(g.rank());
    at::Tensor q = Q.narrow(sdim, mine.begin, mine.size()).contiguous();
    at::Tensor k = K.narrow(sdim, mine.begin, mine.size()).contiguous();
    auto sharding =
        agree_plan(g, part, c.layout, {{q, Heads::kQuery, "q"}, {k, Heads::kKeyValue, "k"}});
    at::Tensor back_q =
        gather_heads(scatter_heads(q, Heads::kQuery, sharding, g), Heads::kQuery, sharding, g);
    EXPECT_TRUE(back_q.equal(q)) << where(g, q);
    at::Tensor back_k = gather_heads(scatter_heads(k, Heads::kKeyValue, sharding, g),
                                     Heads::kKeyValue, sharding, g);
    std::vector<double> copies(c.hkv, 0.0);
    for (const Range& r : part.kv_ranges())
      for (int64_t h = r.begin; h < r.end; ++h) copies[h] += 1.0;
    std::vector<int64_t> bshape(4, 1);
    bshape[hdim] = c.hkv;
    at::Tensor expected = k * at::tensor(copies, at::kFloat).view(bshape);
    EXPECT_TRUE(back_k.equal(expected)) << where(g, k);
  });
}

// scatter against the slice of the full tensor that the partition assigns to this rank, and
// gradients of a random scalar loss against the single-rank reference's.
TEST_P(AllToAll, MatchesSingleRankReference) {
  const Case c = GetParam();
  expect_ranks_succeed(c.P, [&](Group& world) {
    const Group g = with_exchange(world, c);
    auto part = HeadPartition::make(c.hq, c.hkv, c.P);
    auto seq = SequencePartition::even(c.S, c.P);
    const int64_t sdim = seq_dim(c.layout), hdim = head_dim(c.layout);
    const int me = g.rank();
    const Range mine = seq.range(me);
    at::Tensor Q = seeded_randn(full_shape(c.layout, c.B, c.S, c.hq, c.D), 11);
    at::Tensor K = seeded_randn(full_shape(c.layout, c.B, c.S, c.hkv, c.D), 12);
    at::Tensor V = seeded_randn(full_shape(c.layout, c.B, c.S, c.hkv, c.Dv), 13);
    auto shard = [&](const at::Tensor& X) {
      return X.narrow(sdim, mine.begin, mine.size()).contiguous().requires_grad_();
    };
    at::Tensor q = shard(Q), k = shard(K), v = shard(V);
    auto sharding = agree_plan(
        g, part, c.layout,
        {{q, Heads::kQuery, "q"}, {k, Heads::kKeyValue, "k"}, {v, Heads::kKeyValue, "v"}});
    // Per-rank loss weights, reproducible on every rank: W[t][r] for tensor t on rank r.
    auto weight = [&](const at::Tensor& X, Heads h, int r, uint64_t salt) {
      const Range hr = sharding.ranges(h)[r];
      return seeded_randn(X.narrow(hdim, hr.begin, hr.size()).sizes(), 100 * salt + r);
    };
    for (bool fused : {false, true}) {
      std::vector<at::Tensor> ys;
      if (fused) {
        ys = scatter_heads({q, k, v}, {Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue}, sharding,
                           g);
      } else {
        ys = {scatter_heads(q, Heads::kQuery, sharding, g),
              scatter_heads(k, Heads::kKeyValue, sharding, g),
              scatter_heads(v, Heads::kKeyValue, sharding, g)};
      }
      const std::vector<at::Tensor> X{Q, K, V};
      const std::vector<Heads> kinds{Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue};
      at::Tensor loss = at::zeros({});
      for (int t = 0; t < 3; ++t) {
        const Range hr = sharding.ranges(kinds[t])[me];
        EXPECT_TRUE(ys[t].equal(X[t].narrow(hdim, hr.begin, hr.size())))
            << "tensor " << t << " fused=" << fused << " " << where(g, ys[t]);
        loss = loss + (ys[t] * weight(X[t], kinds[t], me, t + 1)).sum();
      }
      loss.backward();
      // Reference: every rank's loss on the full tensors, differentiated on one rank.
      double worst = 0;
      for (int t = 0; t < 3; ++t) {
        at::Tensor full = X[t].clone().requires_grad_();
        at::Tensor ref_loss = at::zeros({});
        for (int r = 0; r < c.P; ++r) {
          const Range hr = sharding.ranges(kinds[t])[r];
          ref_loss =
              ref_loss +
              (full.narrow(hdim, hr.begin, hr.size()) * weight(X[t], kinds[t], r, t + 1)).sum();
        }
        ref_loss.backward();
        at::Tensor expected = full.grad().narrow(sdim, mine.begin, mine.size());
        at::Tensor got = std::vector<at::Tensor>{q, k, v}[t].grad();
        worst = std::max(worst, rel_error(got, expected));
      }
      EXPECT_LT(worst, 1e-6) << "fused=" << fused << " " << where(g, q);
      for (at::Tensor* t : {&q, &k, &v}) t->mutable_grad().reset();
    }
  });
}

// gather_heads' own backward (seq -> heads) against the reference.
TEST_P(AllToAll, GatherBackwardMatchesReference) {
  const Case c = GetParam();
  expect_ranks_succeed(c.P, [&](Group& world) {
    const Group g = with_exchange(world, c);
    auto part = HeadPartition::make(c.hq, c.hkv, c.P);
    auto seq = SequencePartition::even(c.S, c.P);
    const int64_t sdim = seq_dim(c.layout), hdim = head_dim(c.layout);
    const int me = g.rank();
    const Range hr = part.q_range(me), mine = seq.range(me);
    at::Tensor O = seeded_randn(full_shape(c.layout, c.B, c.S, c.hq, c.D), 21);
    at::Tensor W = seeded_randn(full_shape(c.layout, c.B, c.S, c.hq, c.D), 22);
    at::Tensor y = O.narrow(hdim, hr.begin, hr.size()).contiguous().requires_grad_();
    Sharding sharding{part, seq, c.layout};
    at::Tensor o = gather_heads(y, Heads::kQuery, sharding, g);
    at::Tensor w = W.narrow(sdim, mine.begin, mine.size());
    EXPECT_TRUE(o.equal(O.narrow(sdim, mine.begin, mine.size()))) << where(g, o);
    (o * w).sum().backward();
    EXPECT_TRUE(y.grad().equal(W.narrow(hdim, hr.begin, hr.size()))) << where(g, y);
  });
}

// A case on one rank: its sharding (even sequence split) and this rank's tokens.
struct OnRank {
  OnRank(const Case& c, const Group& g)
      : part(HeadPartition::make(c.hq, c.hkv, c.P)),
        sharding{part, SequencePartition::even(c.S, c.P), c.layout},
        me(g.rank()),
        mine(sharding.seq.range(me)) {}
  HeadPartition part;
  Sharding sharding;
  int me;
  Range mine;
};

// Parts (heads split by rank beforehand) exchange like the whole tensors, forward and backward.
void check_parts_match_whole_tensors(const Case& c, const Group& g) {
  const OnRank r(c, g);
  const HeadPartition& part = r.part;
  const Sharding& sharding = r.sharding;
  const int me = r.me;
  const Range mine = r.mine;
  const int64_t sdim = seq_dim(c.layout), hdim = head_dim(c.layout);
  for (Heads kind : {Heads::kQuery, Heads::kKeyValue}) {
    const auto& ranges = sharding.ranges(kind);
    const int64_t H = sharding.total(kind);
    at::Tensor X = seeded_randn(full_shape(c.layout, c.B, c.S, H, c.D), 71);
    at::Tensor x = X.narrow(sdim, mine.begin, mine.size()).contiguous().requires_grad_();
    std::vector<at::Tensor> parts;
    for (const Range& r : ranges) {
      parts.push_back(x.detach().narrow(hdim, r.begin, r.size()).contiguous().requires_grad_());
    }
    at::Tensor whole = scatter_heads(x, kind, sharding, g);
    at::Tensor from_parts = scatter_head_parts(parts, kind, sharding, g);
    EXPECT_TRUE(from_parts.equal(whole)) << where(g, x);
    at::Tensor w = seeded_randn(whole.sizes(), 72 + me);
    (whole * w).sum().backward();
    (from_parts * w).sum().backward();
    at::Tensor summed = at::zeros_like(x);  // Replicated kv parts add up, as gather_heads sums.
    for (size_t j = 0; j < parts.size(); ++j) {
      summed.narrow(hdim, ranges[j].begin, ranges[j].size()).add_(parts[j].grad());
    }
    EXPECT_LT(rel_error(summed, x.grad()), 1e-6) << where(g, x);
  }
  // Q and K parts fused into one exchange.
  {
    at::Tensor Xq = seeded_randn(full_shape(c.layout, c.B, c.S, c.hq, c.D), 75);
    at::Tensor Xk = seeded_randn(full_shape(c.layout, c.B, c.S, c.hkv, c.D), 76);
    at::Tensor xq = Xq.narrow(sdim, mine.begin, mine.size()).contiguous();
    at::Tensor xk = Xk.narrow(sdim, mine.begin, mine.size()).contiguous();
    auto split = [&](const at::Tensor& x, Heads kind) {
      std::vector<at::Tensor> out;
      for (const Range& r : sharding.ranges(kind)) out.push_back(x.narrow(hdim, r.begin, r.size()));
      return out;
    };
    const auto fused = scatter_head_parts({split(xq, Heads::kQuery), split(xk, Heads::kKeyValue)},
                                          {Heads::kQuery, Heads::kKeyValue}, sharding, g);
    const auto whole = scatter_heads({xq, xk}, {Heads::kQuery, Heads::kKeyValue}, sharding, g);
    EXPECT_TRUE(fused[0].equal(whole[0]) && fused[1].equal(whole[1])) << where(g, xq);
  }
  // Gather into parts (query heads: no replicas).
  const Range heads = part.q_range(me);
  at::Tensor Y = seeded_randn(full_shape(c.layout, c.B, c.S, c.hq, c.D), 73);
  at::Tensor y = Y.narrow(hdim, heads.begin, heads.size()).contiguous().requires_grad_();
  const std::vector<at::Tensor> got = gather_head_parts(y, Heads::kQuery, sharding, g);
  ASSERT_EQ(got.size(), static_cast<size_t>(c.P));
  at::Tensor loss = at::zeros({});
  at::Tensor W = seeded_randn(full_shape(c.layout, c.B, c.S, c.hq, c.D), 74);
  for (int j = 0; j < c.P; ++j) {
    const Range r = part.q_range(j);
    EXPECT_TRUE(
        got[j].equal(Y.narrow(sdim, mine.begin, mine.size()).narrow(hdim, r.begin, r.size())))
        << "part " << j << " " << where(g, y);
    loss = loss +
           (got[j] * W.narrow(sdim, mine.begin, mine.size()).narrow(hdim, r.begin, r.size())).sum();
  }
  loss.backward();
  EXPECT_TRUE(y.grad().equal(W.narrow(hdim, heads.begin, heads.size()))) << where(g, y);
}

// The projections into and out of parts (BSHD) equal a Linear around the whole-tensor
// all-to-alls, forward and gradients of the input, the weights and the bias.
void check_projections_through_parts(const Case& c, const Group& g) {
  const OnRank r(c, g);
  const Sharding& sharding = r.sharding;
  const int me = r.me;
  const Range mine = r.mine;
  const int64_t E = 5;
  at::Tensor X = seeded_randn({c.B, c.S, E}, 81);
  for (Heads kind : {Heads::kQuery, Heads::kKeyValue}) {
    const int64_t H = sharding.total(kind);
    at::Tensor x = X.narrow(1, mine.begin, mine.size()).contiguous().requires_grad_();
    at::Tensor w_in = seeded_randn({H * c.D, E}, 82).requires_grad_();
    at::Tensor b_in = seeded_randn({H * c.D}, 83).requires_grad_();
    at::Tensor w_out = seeded_randn({E, H * c.D}, 84).requires_grad_();
    // Reference: Linear, whole all-to-alls, Linear.
    at::Tensor ref_x = x.detach().clone().requires_grad_();
    at::Tensor ref_w_in = w_in.detach().clone().requires_grad_();
    at::Tensor ref_b_in = b_in.detach().clone().requires_grad_();
    at::Tensor ref_w_out = w_out.detach().clone().requires_grad_();
    at::Tensor h = at::linear(ref_x, ref_w_in, ref_b_in).view({c.B, mine.size(), H, c.D});
    at::Tensor y = scatter_heads(h, kind, sharding, g);
    at::Tensor ref = at::linear(gather_heads(y * 0.5, kind, sharding, g).flatten(2), ref_w_out);
    // Through parts.
    const auto& ranges = sharding.ranges(kind);
    at::Tensor yp =
        scatter_head_parts(project_head_parts(x, w_in, b_in, ranges), kind, sharding, g);
    at::Tensor out =
        project_from_head_parts(gather_head_parts(yp * 0.5, kind, sharding, g), w_out, ranges);
    EXPECT_LT(rel_error(out, ref), 1e-5) << where(g, x);
    at::Tensor w = seeded_randn(ref.sizes(), 85 + me);
    (ref * w).sum().backward();
    (out * w).sum().backward();
    EXPECT_LT(rel_error(x.grad(), ref_x.grad()), 1e-5) << where(g, x);
    // Weight gradients are this rank's share; their sums over ranks are the model's.
    EXPECT_LT(rel_error(w_in.grad(), ref_w_in.grad()), 1e-5) << where(g, x);
    EXPECT_LT(rel_error(b_in.grad(), ref_b_in.grad()), 1e-5) << where(g, x);
    EXPECT_LT(rel_error(w_out.grad(), ref_w_out.grad()), 1e-5) << where(g, x);
  }
}

TEST_P(AllToAll, PartsMatchWholeTensorsAndLinear) {
  const Case c = GetParam();
  expect_ranks_succeed(c.P, [&](Group& world) {
    const Group g = with_exchange(world, c);
    check_parts_match_whole_tensors(c, g);
    if (c.layout == Layout::kBSHD) check_projections_through_parts(c, g);
  });
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Layout l : {Layout::kBSHD, Layout::kSBHD, Layout::kBHSD}) {
    out.push_back({1, 4, 2, 7, l});   // P == 1: identity.
    out.push_back({2, 4, 4, 8, l});   // Even MHA.
    out.push_back({3, 7, 7, 10, l});  // Uneven heads, uneven S.
    out.push_back({4, 8, 2, 9, l});   // GQA with kv replicated (Hkv < P).
    out.push_back({2, 2, 1, 5, l});   // MQA.
    out.push_back({4, 6, 2, 13, l});  // GQA group straddling ranks.
    out.push_back({2, 6, 3, 6, l});   // GQA 6/3: q [4,2], kv [2,1].
  }
  out.push_back({4, 12, 12, 4, Layout::kBSHD, 1, 16, 16});  // B = 1: direct receive.
  out.push_back({3, 6, 3, 2, Layout::kBSHD, 1, 4, 4});      // Fewer tokens than ranks.
  out.push_back({2, 4, 2, 6, Layout::kBHSD, 2, 8, 12});     // v head dim != q/k head dim.
  out.push_back({3, 6, 2, 7, Layout::kSBHD, 1, 16, 4});     // Likewise, with replication.
  // The same exchanges as pipelined messages: cut to single tokens (a token's block is larger
  // than 96 bytes in most cases), and in BSHD also one message per block.
  const size_t collective = out.size();
  for (size_t i = 0; i < collective; ++i) {
    if (out[i].P == 1) continue;
    for (int64_t bytes : {96, 1 << 20}) {
      if (bytes > 96 && out[i].layout != Layout::kBSHD) continue;
      Case c = out[i];
      c.message_bytes = bytes;
      out.push_back(c);
    }
    Case c = out[i];  // And through shared memory.
    c.message_bytes = 1 << 20;
    c.shared_memory = true;
    out.push_back(c);
    c.message_bytes = 0;  // And handed over with flags, in one round
    out.push_back(c);
    c.window_bytes = 96;  // and in windows of a token or so, many rounds.
    out.push_back(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Sweep, AllToAll, ::testing::ValuesIn(cases()), case_name);

// Two attention instances with different head counts share the process and interleave.
void interleave(int P, int64_t hq_a, int64_t hkv_a, int64_t hq_b, int64_t hkv_b) {
  expect_ranks_succeed(P, [&](Group& g) {
    const int me = g.rank();
    const Layout L = Layout::kBSHD;
    auto seq = SequencePartition::even(6, P);
    const Range mine = seq.range(me);
    auto part_a = HeadPartition::make(hq_a, hkv_a, P);
    auto part_b = HeadPartition::make(hq_b, hkv_b, P);
    const HeadPartition a_before = part_a;
    at::Tensor A = seeded_randn({1, 6, hq_a, 4}, 31), B = seeded_randn({1, 6, hq_b, 4}, 32);
    at::Tensor a = A.narrow(1, mine.begin, mine.size()).contiguous().requires_grad_();
    at::Tensor b = B.narrow(1, mine.begin, mine.size()).contiguous().requires_grad_();
    auto plan_a = agree_plan(g, part_a, L, {{a, Heads::kQuery, "a"}});
    at::Tensor ya = scatter_heads(a, Heads::kQuery, plan_a, g);
    auto plan_b = agree_plan(g, part_b, L, {{b, Heads::kQuery, "b"}});
    at::Tensor yb = scatter_heads(b, Heads::kQuery, plan_b, g);
    (ya * 2).sum().backward();                                    // A's backward after B's forward.
    at::Tensor ya2 = scatter_heads(a, Heads::kQuery, plan_a, g);  // A again after B.
    (yb * 3).sum().backward();
    const Range ra = part_a.q_range(me), rb = part_b.q_range(me);
    EXPECT_TRUE(ya.equal(A.narrow(2, ra.begin, ra.size())));
    EXPECT_TRUE(ya2.equal(ya));
    EXPECT_TRUE(yb.equal(B.narrow(2, rb.begin, rb.size())));
    EXPECT_TRUE(a.grad().equal(at::full_like(a, 2)));
    EXPECT_TRUE(b.grad().equal(at::full_like(b, 3)));
    EXPECT_EQ(part_a, a_before);
    EXPECT_EQ(plan_a.heads, a_before);
  });
}

TEST(AllToAllInstances, ThreeAndTwoHeadsInterleave) { interleave(2, 3, 3, 2, 2); }
TEST(AllToAllInstances, Gqa6Over3AndMha4Interleave) { interleave(2, 6, 3, 4, 4); }

TEST(AllToAllInstances, TwelveHeadsOverFourAfterOtherInstances) {
  interleave(4, 7, 7, 5, 5);  // Other head counts run first in this process.
  expect_ranks_succeed(4, [](Group& g) {
    at::Tensor x = seeded_randn({1, 2, 12, 4}, 41);
    auto y = scatter_heads(x, HeadPartition::make(12, 12, 4), Heads::kQuery, Layout::kBSHD, g);
    EXPECT_EQ(y.size(2), 3);
    EXPECT_EQ(y.size(1), 8);
  });
}

// Invalid setups: the same clear error on every rank, in seconds, never a hang.
TEST(AllToAllErrors, FewerQueryHeadsThanRanks) {
  auto errors = run_ranks(2, [](Group& g) { HeadPartition::make(1, 1, g.size()); });
  expect_ranks_fail_alike(errors,
                          "query heads (1) must be >= sequence-parallel size (2); each rank "
                          "needs at least one query head");
}

TEST(AllToAllErrors, RanksDisagreeOnLocalSequenceLength) {
  auto errors = run_ranks(2, [](Group& g) {
    at::Tensor x = at::zeros({1, g.rank() == 0 ? 4 : 3, 4, 8});
    agree_plan(g, HeadPartition::make(4, 4, 2), Layout::kBSHD, {{x, Heads::kQuery, "q"}},
               SequencePartition::even(8, 2));
  });
  expect_ranks_fail_alike(errors,
                          "local sequence lengths SequencePartition(S=7, lengths=[4,3]) "
                          "do not match the given SequencePartition(S=8, lengths=[4,4])");
}

// Note [No silent S x S]: where C++ runs a call's rules on SDPA off the CPU, their dense mask
// [B, 1, S, S] (4 bytes an entry) may take kSquareMaxBytes: S = 16384 fits, one token more is
// refused alike on every rank; on the CPU (the fused kernel) no bound.
TEST(AllToAllErrors, RuleMaskAboveItsBoundOffTheCpu) {
  const int64_t fits = 16384;
  for (int64_t S : {fits, fits + 1}) {
    for (bool on_cpu : {false, true}) {
      auto errors = run_ranks(2, [&](Group& g) {
        const auto seq = SequencePartition::even(S, 2);
        at::Tensor q = at::empty({1, seq.length(g.rank()), 2, 8},
                                 at::TensorOptions().device(on_cpu ? at::kCPU : at::kMeta));
        CallOptions call;
        call.attention = true;
        call.local_kernel = static_cast<int64_t>(LocalKernel::kAuto);
        call.causal = true;
        call.window = 64;
        agree_plan(
            g, HeadPartition::make(2, 2, 2), Layout::kBSHD,
            {{q, Heads::kQuery, "q"}, {q, Heads::kKeyValue, "k"}, {q, Heads::kKeyValue, "v"}},
            c10::nullopt, call);
      });
      if (S == fits || on_cpu) {
        EXPECT_EQ(errors, (std::vector<std::string>{"", ""})) << S << on_cpu;
      } else {
        expect_ranks_fail_alike(errors,
                                "off the CPU the C++ API would run this call on SDPA with its "
                                "causal, window and document rules as a dense mask [B=1, 1, "
                                "S=16385, S] of 1073872900 bytes");
      }
    }
  }
}

// Note [No silent S x S]: off the CPU (the meta device stands in for a GPU: no data moves in an
// agreement), a softcap sends "auto" to the math kernel, whose fp32 scores [B, heads, S, S] of
// the largest rank (7 heads over 2 ranks: 4) may take kSquareMaxBytes; one token more is
// refused alike on every rank. On the CPU (the fused kernel) and with SDPA's cases, no bound.
TEST(AllToAllErrors, MathKernelScoresAboveTheirBoundOffTheCpu) {
  // 4 heads x S^2 x 4 bytes = 2^30 at S = 2^13.
  const int64_t fits = 8192;
  for (int64_t S : {fits, fits + 1}) {
    for (bool on_cpu : {false, true}) {
      for (bool softcap : {true, false}) {
        auto errors = run_ranks(2, [&](Group& g) {
          const auto seq = SequencePartition::even(S, 2);
          at::Tensor q = at::empty({1, seq.length(g.rank()), 7, 8},
                                   at::TensorOptions().device(on_cpu ? at::kCPU : at::kMeta));
          CallOptions call;
          call.attention = true;
          call.local_kernel = static_cast<int64_t>(LocalKernel::kAuto);
          call.softcap = softcap ? 30.0 : 0.0;
          agree_plan(
              g, HeadPartition::make(7, 7, 2), Layout::kBSHD,
              {{q, Heads::kQuery, "q"}, {q, Heads::kKeyValue, "k"}, {q, Heads::kKeyValue, "v"}},
              c10::nullopt, call);
        });
        if (S == fits || on_cpu || !softcap) {
          EXPECT_EQ(errors, (std::vector<std::string>{"", ""})) << S << on_cpu << softcap;
        } else {
          expect_ranks_fail_alike(errors,
                                  "off the CPU this call would run the math kernel (SDPA has no "
                                  "softcap), whose fp32 scores [B=1, heads=4, S=8193, S] take "
                                  "1074003984 bytes, above its bound of 1073741824");
        }
      }
    }
  }
}

TEST(AllToAllErrors, RanksDisagreeOnHeadCount) {
  auto errors = run_ranks(2, [](Group& g) {
    const int64_t h = g.rank() == 0 ? 4 : 6;
    at::Tensor x = at::zeros({1, 4, h, 8});
    scatter_heads(x, HeadPartition::make(h, h, 2), Heads::kQuery, Layout::kBSHD, g);
  });
  expect_ranks_fail_alike(errors,
                          "agree_plan: ranks disagree on q_heads: rank 0 has 4, rank 1 has 6");
}

TEST(AllToAllErrors, TensorOfWrongRankOnOneRank) {
  auto errors = run_ranks(3, [](Group& g) {
    at::Tensor x = g.rank() == 1 ? at::zeros({4, 3, 8}) : at::zeros({1, 4, 3, 8});
    scatter_heads(x, HeadPartition::make(3, 3, 3), Heads::kQuery, Layout::kBSHD, g);
  });
  // The failing rank is named once, by the agreement ("raised on"), the same on every rank.
  expect_ranks_fail_alike(errors,
                          "x must be a 4-D tensor in layout BSHD; got [4, 3, 8] [raised on rank 1 "
                          "of 3]");
}

TEST(AllToAllErrors, WrongHeadCountForPartition) {
  auto errors = run_ranks(2, [](Group& g) {
    at::Tensor x = at::zeros({1, 4, 5, 8});
    scatter_heads(x, HeadPartition::make(4, 2, 2), Heads::kQuery, Layout::kBSHD, g);
  });
  expect_ranks_fail_alike(errors,
                          "x must have 4 query heads in dim 2 (layout BSHD); got shape "
                          "[1, 4, 5, 8]");
}

TEST(AllToAllErrors, PartsOfTheWrongShapeNameThePart) {
  auto errors = run_ranks(2, [](Group& g) {
    const Sharding sharding{HeadPartition::make(5, 5, 2), SequencePartition::even(4, 2),
                            Layout::kBSHD};
    // Ranks get heads [0, 3) and [3, 5); part 1 here has 3.
    scatter_head_parts({at::zeros({1, 2, 3, 4}), at::zeros({1, 2, 3, 4})}, Heads::kQuery, sharding,
                       g);
  });
  // A local check, like scatter_heads' against a given sharding (agree_plan or
  // DistributedAttention::forward_parts are the fail-together steps): each rank names itself.
  ASSERT_EQ(errors.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("scatter_head_parts: part 1 must hold 2 query heads in dim 2"),
              std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("(rank " + std::to_string(r) + ")"), std::string::npos) << errors[r];
  }
}

// One rank's group handle pipelines differently: the ranks would take different exchange
// paths and wait on each other, so the sharding's agreement refuses it on every rank.
// Rank 1's options differ from rank 0's by `differ`: the exchange paths would differ, so the
// sharding's agreement fails both alike with `message`.
void expect_options_disagreement(const std::function<void(GroupOptions&)>& differ,
                                 const std::string& message) {
  auto errors = run_ranks(2, [&](Group& world) {
    GroupOptions options = world.options();
    options.shared_memory = false;  // Whatever the environment says.
    options.transport = GroupOptions::Transport::kMessages;
    if (world.rank() == 1) differ(options);
    const Group g = world.with_options(options);
    at::Tensor x = at::zeros({1, 3, 4, 8});
    agree_plan(g, HeadPartition::make(4, 4, 2), Layout::kBSHD, {{x, Heads::kQuery, "x"}});
  });
  expect_ranks_fail_alike(errors, message);
}

TEST(AllToAllErrors, RanksDisagreeOnExchangeOptions) {
  expect_options_disagreement([](GroupOptions& o) { o.message_bytes = 1 << 10; },
                              "ranks disagree on GroupOptions::message_bytes: rank 0 has 4194304, "
                              "rank 1 has 1024");
  expect_options_disagreement(
      [](GroupOptions& o) { o.shared_memory = true; },
      "ranks disagree on GroupOptions::shared_memory: rank 0 has no, rank 1 has yes");
  expect_options_disagreement(
      [](GroupOptions& o) { o.transport = GroupOptions::Transport::kBatched; },
      "ranks disagree on whether transfers are batched (GroupOptions::transport): rank 0 has "
      "no, rank 1 has yes");
}

TEST(AllToAllErrors, RanksDisagreeOnDtype) {
  auto errors = run_ranks(2, [](Group& g) {
    at::Tensor x = at::zeros({1, 4, 2, 8}, g.rank() == 0 ? at::kFloat : at::kDouble);
    scatter_heads(x, HeadPartition::make(2, 2, 2), Heads::kQuery, Layout::kBSHD, g);
  });
  expect_ranks_fail_alike(errors, "ranks disagree on x's dtype");
}

TEST(AllToAllDtypes, Bfloat16RoundTrip) {
  expect_ranks_succeed(2, [](Group& world) {
    at::Tensor x = seeded_randn({2, 3, 4, 8}, 51).to(at::kBFloat16);
    auto sharding =
        agree_plan(world, HeadPartition::make(4, 4, 2), Layout::kBSHD, {{x, Heads::kQuery, "x"}});
    for (int64_t message_bytes : {0, 64}) {
      const Group g = with_exchange(world, Case{2, 4, 4, 6, Layout::kBSHD, 2, 8, 8, message_bytes});
      EXPECT_TRUE(
          gather_heads(scatter_heads(x, Heads::kQuery, sharding, g), Heads::kQuery, sharding, g)
              .equal(x))
          << "message_bytes " << message_bytes;
    }
  });
}

// Large exchanges take pipelined messages by default, smaller ones one collective; the choice
// follows the whole exchange's size, which every rank sees alike even when its own share
// differs (uneven heads and tokens), and a group's options can turn pipelining off. The
// batched transport never pipelines: one collective whatever the size.
TEST(AllToAllPipeline, ChosenBySizeAlikeOnEveryRank) {
  expect_ranks_succeed(3, [](Group& g) {
    const auto part = HeadPartition::make(7, 7, 3);
    const auto seq = SequencePartition::even(10, 3);
    const Range mine = seq.range(g.rank());
    at::Tensor X = seeded_randn({1, 10, 7, 8}, 61);
    at::Tensor x = X.narrow(1, mine.begin, mine.size()).contiguous();
    const Sharding sharding{part, seq, Layout::kBSHD};
    // 10 x 7 x 8 fp32 elements: 2240 bytes in all, 746 per rank.
    for (auto transport : {GroupOptions::Transport::kMessages, GroupOptions::Transport::kBatched})
      for (int64_t min_bytes : {int64_t{0}, int64_t{746}, int64_t{747}, int64_t{4} << 20}) {
        GroupOptions options = g.options();
        options.pipeline_min_bytes = min_bytes;
        options.message_bytes = 32;
        options.transport = transport;
        options.shared_memory = false;  // Counts messages: none through /dev/shm.
        const Group h = g.with_options(options);
        const int64_t collectives = h.recorder().collectives(),
                      messages = h.recorder().p2p_messages();
        at::Tensor y = scatter_heads(x, Heads::kQuery, sharding, h);
        const bool pipelined = min_bytes <= 746 && transport == GroupOptions::Transport::kMessages;
        EXPECT_EQ(h.recorder().collectives() - collectives, pipelined ? 0 : 1) << min_bytes;
        // One message per token to each of the two peers (a token's 2 or 3 heads exceed 32 bytes).
        EXPECT_EQ(h.recorder().p2p_messages() - messages, pipelined ? 2 * mine.size() : 0)
            << min_bytes;
        const Range heads = part.q_range(g.rank());
        EXPECT_TRUE(y.equal(X.narrow(2, heads.begin, heads.size()))) << min_bytes;
      }
  });
}

// Through shared memory, blocks skip the messages: each exchange sends each co-located peer
// two notices (4 + 1 int64), and the result is the same bit for bit. The links are set up once.
TEST(AllToAllSharedMemory, BlocksBypassMessages) {
  expect_ranks_succeed(3, [](Group& world) {
    const Case c{3, 7, 7, 10, Layout::kBSHD, 2, 8, 8, 1 << 20, true};
    GroupOptions messages = world.options();  // Shared memory serves the messages path.
    messages.transport = GroupOptions::Transport::kMessages;
    const Group g = with_exchange(world.with_options(messages), c),
                plain = with_exchange(world, {3, 7, 7, 10, Layout::kBSHD, 2, 8, 8, 1 << 20, false});
    const auto seq = SequencePartition::even(c.S, c.P);
    at::Tensor X = seeded_randn({c.B, c.S, c.hq, c.D}, 71);
    const Range mine = seq.range(g.rank());
    at::Tensor x = X.narrow(1, mine.begin, mine.size()).contiguous();
    auto sharding =
        agree_plan(g, HeadPartition::make(c.hq, c.hkv, c.P), c.layout, {{x, Heads::kQuery, "x"}});
    scatter_heads(x, Heads::kQuery, sharding, g);  // Sets the links up.
    const int64_t bytes = g.recorder().p2p_bytes(), collectives = g.recorder().collectives();
    at::Tensor y = scatter_heads(x, Heads::kQuery, sharding, g);
    EXPECT_EQ(g.recorder().p2p_bytes() - bytes, 2 * (4 + 1) * 8);
    EXPECT_EQ(g.recorder().collectives(), collectives);
    EXPECT_TRUE(y.equal(scatter_heads(x, Heads::kQuery, sharding, plain)));
    EXPECT_TRUE(gather_heads(y, Heads::kQuery, sharding, g).equal(x));
  });
}

// Small exchanges between ranks of one host hand over with flags in their outboxes' control
// pages (Note [Flag handshake]): no message, one collective counted, and the same result bit for
// bit as the collective, whole tensors fused (uneven query heads, kv heads replicated) and back
// (replicas summed); small and larger (S = 3000). The sweep's `_flags96` cases go through windows
// of a token or so, many rounds.
TEST(AllToAllSharedMemory, SmallExchangesHandOverWithFlags) {
  expect_ranks_succeed(3, [](Group& world) {
    GroupOptions on = world.options(), off = world.options();
    on.transport = off.transport = GroupOptions::Transport::kMessages;
    on.shared_memory = true;
    off.shared_memory = false;
    const Group g = world.with_options(on), plain = world.with_options(off);
    const auto part = HeadPartition::make(4, 1, 3);  // q heads 2, 1, 1; the kv head on all three.
    for (int64_t S : {10, 3000}) {
      const auto seq = SequencePartition::even(S, 3);
      const Range mine = seq.range(g.rank());
      at::Tensor q = seeded_randn({2, S, 4, 8}, 81).narrow(1, mine.begin, mine.size()).contiguous();
      at::Tensor k = seeded_randn({2, S, 1, 8}, 82).narrow(1, mine.begin, mine.size()).contiguous();
      const Sharding sharding{part, seq, Layout::kBSHD};
      const std::vector<Heads> heads{Heads::kQuery, Heads::kKeyValue};
      scatter_heads({q, k}, heads, sharding, g);  // Sets the links up (S = 10).
      const int64_t collectives = g.recorder().collectives(),
                    messages = g.recorder().p2p_messages(), flags = g.recorder().flag_exchanges();
      const auto y = scatter_heads({q, k}, heads, sharding, g);
      EXPECT_EQ(g.recorder().collectives() - collectives, 1);
      EXPECT_EQ(g.recorder().flag_exchanges() - flags, 1);
      EXPECT_EQ(g.recorder().p2p_messages() - messages, 0);
      const auto want = scatter_heads({q, k}, heads, sharding, plain);
      EXPECT_TRUE(y[0].equal(want[0]) && y[1].equal(want[1])) << S;
      const auto back = gather_heads(y, heads, sharding, g);
      const auto back_want = gather_heads(want, heads, sharding, plain);
      EXPECT_TRUE(back[0].equal(q) && back[1].equal(back_want[1])) << S;
    }
  });
}

// An exchange far larger than its windows goes round by round through an outbox that stays at
// its bound (two windows of about message_bytes, in whole MiB): 8 MiB for the peer here, in 2 MiB.
TEST(AllToAllSharedMemory, LargeExchangeKeepsTheOutboxBounded) {
  expect_ranks_succeed(2, [](Group& world) {
    GroupOptions on = world.options(), off = world.options();
    on.transport = off.transport = GroupOptions::Transport::kMessages;
    on.shared_memory = true;
    on.message_bytes = int64_t{1} << 20;
    off.shared_memory = false;
    const Group g = world.with_options(on), plain = world.with_options(off);
    const int64_t S = 32768;
    const Sharding sharding{HeadPartition::make(8, 8, 2), SequencePartition::even(S, 2),
                            Layout::kBSHD};
    const Range mine = sharding.seq.range(g.rank());
    at::Tensor x = seeded_randn({1, S, 8, 32}, 91).narrow(1, mine.begin, mine.size()).contiguous();
    const int64_t flags = g.recorder().flag_exchanges();
    const at::Tensor y = scatter_heads(x, Heads::kQuery, sharding, g);
    EXPECT_EQ(g.recorder().flag_exchanges() - flags, 1);
    EXPECT_LE(g.runtime().links(g).outbox_bytes(), int64_t{2} << 20);
    EXPECT_TRUE(y.equal(scatter_heads(x, Heads::kQuery, sharding, plain)));
    EXPECT_TRUE(gather_heads(y, Heads::kQuery, sharding, g).equal(x));
  });
}

// A peer that skips a small exchange through shared memory: the others raise after the timeout,
// as a collective's wait does, and say where they wait well before.
TEST(AllToAllSharedMemory, AbsentPeerInAFlagHandshakeIsAnErrorNotAHang) {
  const auto seq = SequencePartition::even(4, 2);
  const Sharding sharding{HeadPartition::make(2, 2, 2), seq, Layout::kBSHD};
  const at::Tensor x = at::ones({1, 2, 2, 4});
  const auto run = run_with_absent_peer(
      [&](Group& world) {
        GroupOptions on = world.options();
        on.transport = GroupOptions::Transport::kMessages;
        on.shared_memory = true;
        const Group g = world.with_options(on);
        scatter_heads(x, Heads::kQuery, sharding, g);  // Both: the links are set up.
        return g;
      },
      [&](const Group& g) { scatter_heads(x, Heads::kQuery, sharding, g); });
  EXPECT_NE(run.error.find("shared-memory exchange #"), std::string::npos) << run.error;
  EXPECT_NE(run.error.find("failed on rank 0 of 2 (timeout 2500 ms; a peer may have died or "
                           "skipped it): still waiting for ranks 1"),
            std::string::npos)
      << run.error;
  EXPECT_NE(run.log.find("rank 0 of 2 has waited 0.6 s of its 2.5 s timeout in shared-memory "
                         "exchange #"),
            std::string::npos)
      << run.log;
}

// all_gather_sequence and reduce_scatter_sequence at P = 3 over S = 10 (4, 3, 3): forward
// against the full tensor, backward against the adjoint; each backward is one collective (the
// forward agreed on the shapes, so the backward does not agree again).
TEST(SequenceCollectives, GatherAndScatterMatchTheFullTensorForwardAndBackward) {
  const int64_t S = 10;
  expect_ranks_succeed(3, [&](Group& g) {
    const auto seq = SequencePartition::even(S, 3);
    const Range mine = seq.range(g.rank());
    at::Tensor full = seeded_randn({2, S, 5}, 1);
    at::Tensor x = full.narrow(1, mine.begin, mine.size()).clone().requires_grad_();
    at::Tensor gathered = all_gather_sequence(x, 1, seq, g);
    EXPECT_TRUE(gathered.equal(full));
    at::Tensor w = seeded_randn({2, S, 5}, 2 + g.rank());  // Each rank's own upstream gradient.
    const int64_t before = g.recorder().collectives();
    (gathered * w).sum().backward();
    EXPECT_EQ(g.recorder().collectives() - before, 1);
    at::Tensor w_sum =
        seeded_randn({2, S, 5}, 2) + seeded_randn({2, S, 5}, 3) + seeded_randn({2, S, 5}, 4);
    EXPECT_LT(rel_error(x.grad(), w_sum.narrow(1, mine.begin, mine.size())), 1e-6);

    at::Tensor y = seeded_randn({2, S, 5}, 5 + g.rank()).requires_grad_();
    at::Tensor scattered = reduce_scatter_sequence(y, 1, seq, g);
    at::Tensor y_sum =
        seeded_randn({2, S, 5}, 5) + seeded_randn({2, S, 5}, 6) + seeded_randn({2, S, 5}, 7);
    EXPECT_LT(rel_error(scattered, y_sum.narrow(1, mine.begin, mine.size())), 1e-6);
    at::Tensor v = seeded_randn({2, mine.size(), 5}, 8 + g.rank());
    const int64_t before_scatter = g.recorder().collectives();
    (scattered * v).sum().backward();
    EXPECT_EQ(g.recorder().collectives() - before_scatter, 1);
    at::Tensor v_full = at::cat(
        {seeded_randn({2, 4, 5}, 8), seeded_randn({2, 3, 5}, 9), seeded_randn({2, 3, 5}, 10)}, 1);
    EXPECT_LT(rel_error(y.grad(), v_full), 1e-6);
  });
}

}  // namespace
}  // namespace ulysses
