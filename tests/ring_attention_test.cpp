// Ring attention and hybrid Ulysses x ring attention against single-rank attention, forward
// and backward; the zigzag layout; the kernel's global rows; the merge; the planner's counts.
#include "ulysses/ring_attention.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <sstream>

#include "testing.h"
#include "ulysses/collective_recorder.h"
#include "ulysses/distributed_attention.h"
#include "ulysses/flash_attention.h"

namespace ulysses {
namespace {

using testing::expect_ranks_fail_alike;
using testing::expect_ranks_succeed;
using testing::rel_error;
using testing::run_ranks;
using testing::seeded_randn;
using testing::where;

// Position ids of packed documents: row b restarts every 3 + 2b tokens.
at::Tensor packed_positions(int64_t B, int64_t S) {
  at::Tensor pos = at::empty({B, S}, at::kLong);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i) pos[b][i] = i % (3 + 2 * b);
  return pos;
}

TEST(RingLayout, ZigzagShardsPartitionTheSequenceAndRoundTrip) {
  for (int64_t U : {1, 2, 3})
    for (int64_t R : {1, 2, 3, 4})
      for (int64_t S : {0, 1, 5, 8, 13, 24}) {
        const RingLayout layout = RingLayout::make(S, U, R);
        at::Tensor seen = at::zeros({S}, at::kLong);
        for (int64_t r = 0; r < R; ++r) {
          at::Tensor idx = layout.ring_index(r);
          EXPECT_EQ(idx.numel(), layout.ring_length(r));
          if (idx.numel() > 1) EXPECT_TRUE(idx.diff().gt(0).all().item<bool>()) << "increasing";
          // Chunks r and 2R-1-r of the even split into 2R chunks.
          const auto chunks = SequencePartition::even(S, 2 * R);
          EXPECT_EQ(layout.ring_length(r), chunks.length(r) + chunks.length(2 * R - 1 - r));
          for (int64_t u = 0; u < U; ++u) {
            at::Tensor mine = layout.shard_index(r * U + u);
            if (mine.numel()) seen.index_add_(0, mine, at::ones_like(mine));
          }
        }
        EXPECT_TRUE(seen.eq(1).all().item<bool>()) << "S=" << S << " U=" << U << " R=" << R;
        at::Tensor x = at::arange(2 * S).view({2, S}).to(at::kFloat);
        std::vector<at::Tensor> shards;
        for (int64_t p = 0; p < U * R; ++p) shards.push_back(layout.shard(x, 1, p));
        EXPECT_TRUE(layout.unshard(shards, 1).equal(x));
      }
  // R = 1 is the contiguous Ulysses split.
  EXPECT_TRUE(RingLayout::make(7, 3, 1).shard_index(1).equal(at::arange(3, 5, at::kLong)));
  // R = 2, S = 8: chunks of 2; ring rank 0 holds tokens 0,1,6,7.
  EXPECT_TRUE(RingLayout::make(8, 1, 2).ring_index(0).equal(at::tensor({0, 1, 6, 7}, at::kLong)));
}

// Queries and keys at scattered global rows (increasing), causal and packed documents: the
// kernel equals the math reference on the same rows, forward and backward.
TEST(FlashGlobalRows, MatchesMathAttention) {
  for (bool causal : {false, true})
    for (bool docs : {false, true}) {
      const int64_t B = 2, Hq = 4, Hkv = 2, Sq = 37, Sk = 29, D = 8;
      at::Tensor q = seeded_randn({B, Hq, Sq, D}, 1), k = seeded_randn({B, Hkv, Sk, D}, 2);
      at::Tensor v = seeded_randn({B, Hkv, Sk, D}, 3), w = seeded_randn({B, Hq, Sq, D}, 4);
      GlobalRows rows;
      rows.q_index = at::arange(Sq, at::kLong) * 3 + 5;  // Queries interleaved with keys.
      rows.k_index = at::arange(Sk, at::kLong) * 4;
      if (docs) {
        rows.q_docs = at::div(rows.q_index, 20, "floor").unsqueeze(0);
        rows.k_docs = at::div(rows.k_index, 20, "floor").unsqueeze(0);
      }
      LocalAttentionArgs a;
      a.kv_map = {0, 0, 1, 1};
      a.causal = causal;
      a.rows = rows;
      std::vector<at::Tensor> outs, grads;
      for (bool fused : {true, false}) {
        // The reference in fp64: ATen's fp32 matmul here gave 7e-5 off its usual result in
        // about one process in thirty (2 threads, an Intel host), whatever the kernel does.
        const auto dtype = fused ? at::kFloat : at::kDouble;
        a.q = q.to(dtype, false, /*copy=*/true).requires_grad_();
        a.k = k.to(dtype, false, /*copy=*/true).requires_grad_();
        a.v = v.to(dtype, false, /*copy=*/true).requires_grad_();
        FlashOptions small;
        small.block_q = 8, small.block_k = 16;  // Several tiles, some skipped.
        at::Tensor o = fused ? flash_attention(a, small) : math_attention(a);
        (o * w.to(dtype)).sum().backward();
        outs.push_back(o);
        for (const at::Tensor& t : {a.q, a.k, a.v}) grads.push_back(t.grad());
      }
      EXPECT_LT(rel_error(outs[0], outs[1]), 1e-5) << "causal " << causal << " docs " << docs;
      for (int i = 0; i < 3; ++i) EXPECT_LT(rel_error(grads[i], grads[i + 3]), 1e-4) << i;
    }
}

// Two partial attentions over disjoint key sets merge into the attention over all keys, and
// the merge's gradients are those of the whole.
TEST(MergeAttention, EqualsAttentionOverTheUnionForwardAndBackward) {
  const int64_t B = 1, H = 2, S = 9, Sk = 12, D = 4;
  at::Tensor Q = seeded_randn({B, H, S, D}, 1), K = seeded_randn({B, H, Sk, D}, 2);
  at::Tensor V = seeded_randn({B, H, Sk, D}, 3), W = seeded_randn({B, H, S, D}, 4);
  const double scale = 0.5;
  auto partial = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    at::Tensor s = at::matmul(q, k.transpose(-1, -2)) * scale;
    at::Tensor lse = s.logsumexp(-1);
    return std::make_pair(at::matmul((s - lse.unsqueeze(-1)).exp(), v), lse);
  };
  std::vector<at::Tensor> grads, outs;
  for (bool merged : {true, false}) {
    at::Tensor q = Q.clone().requires_grad_(), k = K.clone().requires_grad_();
    at::Tensor v = V.clone().requires_grad_();
    at::Tensor o;
    if (merged) {
      auto [oa, la] = partial(q, k.slice(2, 0, 5), v.slice(2, 0, 5));
      auto [ob, lb] = partial(q, k.slice(2, 5), v.slice(2, 5));
      o = std::get<0>(merge_attention(oa, la, ob, lb));
    } else {
      o = partial(q, k, v).first;
    }
    (o * W).sum().backward();
    outs.push_back(o);
    for (const at::Tensor& t : {q, k, v}) grads.push_back(t.grad());
  }
  EXPECT_LT(rel_error(outs[0], outs[1]), 1e-6);
  for (int i = 0; i < 3; ++i) EXPECT_LT(rel_error(grads[i], grads[i + 3]), 1e-5) << i;
  // An empty part (lse = +inf, out = 0) weighs nothing; two empty parts stay empty.
  at::Tensor inf = at::full({1}, std::numeric_limits<float>::infinity());
  auto [o1, l1] = merge_attention(at::ones({1, 2}), at::zeros({1}), at::zeros({1, 2}), inf);
  EXPECT_TRUE(o1.equal(at::ones({1, 2})) && l1.item<float>() == 0.0f);
  auto [o2, l2] = merge_attention(at::zeros({1, 2}), inf, at::zeros({1, 2}), inf);
  EXPECT_TRUE(o2.equal(at::zeros({1, 2})) && std::isinf(l2.item<float>()));
}

// Masks: rows sharded (this rank's tokens), full (all S) or broadcast (1); keys in global order.
enum class Mask {
  kNone,
  kBoolSharded,
  kFloatLearnableSharded,
  kFloatLearnablePerHeadFull,
  kKeyPadding
};

struct Case {
  int U, R;
  int64_t hq, hkv, S;
  bool causal = false, packed = false;
  Mask mask = Mask::kNone;
  int64_t B = 2, D = 8;
};
std::string describe(const Case& c) {
  static const char* masks[] = {"", "_bool_mask", "_learnable_bias", "_per_head_full_bias",
                                "_key_padding"};
  std::ostringstream os;
  os << c.U << "x" << c.R << "_q" << c.hq << "_kv" << c.hkv << "_S" << c.S
     << (c.causal ? "_causal" : "") << (c.packed ? "_packed" : "")
     << masks[static_cast<int>(c.mask)];
  return os.str();
}

// The full mask of a case ([B or 1, 1 or Hq, S or 1, S]) and whether its rows are sharded.
std::pair<at::Tensor, bool> full_mask(const Case& c) {
  switch (c.mask) {
    case Mask::kNone:
      return {at::Tensor(), false};
    case Mask::kBoolSharded:
      return {seeded_randn({c.B, 1, c.S, c.S}, 5).gt(-0.8), true};
    case Mask::kFloatLearnableSharded:
      return {seeded_randn({c.B, 1, c.S, c.S}, 5), true};
    case Mask::kFloatLearnablePerHeadFull:
      return {seeded_randn({1, c.hq, c.S, c.S}, 5), false};
    case Mask::kKeyPadding: {
      at::Tensor m = at::ones({c.B, 1, 1, c.S}, at::kBool);
      m.index_put_({0, 0, 0, at::indexing::Slice(c.S - 3)}, false);
      return {m, false};
    }
  }
  return {};
}
void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

// This rank's Ulysses group (U consecutive ranks) and ring group (stride U).
std::pair<Group, Group> hybrid_groups(const Group& world, int U, int R) {
  std::vector<std::vector<int>> ulysses(R), ring(U);
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) ulysses[r].push_back(r * U + u), ring[u].push_back(r * U + u);
  auto make = [&](const std::vector<std::vector<int>>& partition) {
    if (partition.size() == 1) return world;
    if (partition[0].size() == 1) return Group::solo(world.options());
    return testing::thread_split(world)(partition);
  };
  return {make(ulysses), make(ring)};
}

// Hybrid attention on U x R ranks equals one rank's attention on the full sequence.
void check_case(const Case& c) {
  expect_ranks_succeed(c.U * c.R, [&](Group& world) {
    auto [ulysses, ring] = hybrid_groups(world, c.U, c.R);
    const RingLayout layout = RingLayout::make(c.S, c.U, c.R);
    const int p = world.rank();
    // BSHD.
    at::Tensor Q = seeded_randn({c.B, c.S, c.hq, c.D}, 1),
               K = seeded_randn({c.B, c.S, c.hkv, c.D}, 2);
    at::Tensor V = seeded_randn({c.B, c.S, c.hkv, c.D}, 3),
               W = seeded_randn({c.B, c.S, c.hq, c.D}, 4);
    auto shard = [&](const at::Tensor& X) { return layout.shard(X, 1, p); };
    at::Tensor q = shard(Q).requires_grad_(), k = shard(K).requires_grad_();
    at::Tensor v = shard(V).requires_grad_();
    at::Tensor pos = packed_positions(c.B, c.S);
    AttentionInputs in;
    if (c.packed) in.positions = shard(pos);
    auto [M, sharded_rows] = full_mask(c);
    const bool learnable = M.defined() && M.is_floating_point();
    at::Tensor m;
    if (M.defined()) {
      m = (sharded_rows ? layout.shard(M, 2, p) : M).clone();
      if (learnable) m.requires_grad_();
      in.mask = m;
    }
    AttentionOptions opts;
    opts.causal = c.causal;
    DistributedAttention attention(ulysses, ring, opts);
    at::Tensor o = attention(q, k, v, in);
    (o * shard(W)).sum().backward();

    at::Tensor Qr = Q.clone().requires_grad_(), Kr = K.clone().requires_grad_();
    at::Tensor Vr = V.clone().requires_grad_();
    LocalAttentionArgs ref;
    ref.q = Qr.permute({0, 2, 1, 3}), ref.k = Kr.permute({0, 2, 1, 3});
    ref.v = Vr.permute({0, 2, 1, 3});
    ref.kv_map = HeadPartition::make(c.hq, c.hkv, 1).kv_map(0);
    if (c.packed) ref.positions = pos;
    at::Tensor Mr = M.defined() ? M.clone() : M;
    if (learnable) Mr.requires_grad_();
    if (M.defined()) ref.mask = Mr;
    ref.causal = c.causal;
    at::Tensor O = math_attention(ref).permute({0, 2, 1, 3});
    (O * W).sum().backward();
    EXPECT_LT(rel_error(o, shard(O)), 1e-4) << "output " << where(world, o);
    // Absolute below 1: a rank whose only query sees only itself has dq = 0 exactly in the
    // reference and ~1e-7 in fp32 (seen at 1 x 4, S = 5, causal, with and without this change).
    EXPECT_LT(rel_error(q.grad(), shard(Qr.grad()), 1.0), 1e-4) << "dq " << where(world, q);
    EXPECT_LT(rel_error(k.grad(), shard(Kr.grad()), 1.0), 1e-4) << "dk " << where(world, k);
    EXPECT_LT(rel_error(v.grad(), shard(Vr.grad()), 1.0), 1e-4) << "dv " << where(world, v);
    if (learnable && sharded_rows) {
      EXPECT_LT(rel_error(m.grad(), layout.shard(Mr.grad(), 2, p)), 1e-4) << "dmask";
    } else if (learnable) {  // Every rank's share of a full mask's gradient: their sum.
      at::Tensor sum = m.grad().contiguous();
      world.all_reduce_sum(sum);
      EXPECT_LT(rel_error(sum, Mr.grad()), 1e-4) << "dmask (summed over ranks)";
    }
  });
}

class HybridAttentionCase : public ::testing::TestWithParam<Case> {};
TEST_P(HybridAttentionCase, MatchesSingleRankAttention) { check_case(GetParam()); }

std::vector<Case> cases() {
  std::vector<Case> out;
  const std::vector<std::pair<int, int>> meshes{{1, 2}, {2, 1}, {2, 2}, {1, 4},
                                                {4, 1}, {3, 1}, {1, 3}};
  for (auto [U, R] : meshes) {
    out.push_back({U, R, 4, 2, 13});              // GQA, S not divisible by the SP size.
    out.push_back({U, R, 4, 2, 13, true});        // Causal.
    out.push_back({U, R, 6, 3, 14, true, true});  // Causal packed documents.
  }
  out.push_back({2, 2, 8, 1, 11, true});         // MQA: Hkv < U x R, kv replicated over U.
  out.push_back({2, 2, 6, 2, 10, false, true});  // Packed, bidirectional.
  out.push_back({3, 1, 7, 7, 9, true});          // Uneven heads.
  out.push_back({2, 2, 5, 5, 9, true});          // Uneven heads in the Ulysses group of a 2x2.
  out.push_back({1, 4, 2, 2, 5, true});          // Fewer tokens than zigzag chunks.
  for (auto [U, R] : std::vector<std::pair<int, int>>{{2, 2}, {1, 3}}) {
    for (Mask m : {Mask::kBoolSharded, Mask::kFloatLearnableSharded,
                   Mask::kFloatLearnablePerHeadFull, Mask::kKeyPadding}) {
      out.push_back({U, R, 4, 2, 13, m == Mask::kBoolSharded, false, m});
    }
  }
  out.push_back({2, 2, 4, 2, 14, true, true, Mask::kFloatLearnableSharded});  // All three.
  return out;
}
INSTANTIATE_TEST_SUITE_P(Meshes, HybridAttentionCase, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return describe(info.param); });

// bf16 inputs: blocks travel in bf16, partial results merge and gradients add up in fp32, so the
// error is that of bf16 inputs alone (checked against the fp64 reference at bf16's precision).
TEST(RingAttention, Bf16MatchesTheReferenceAtBf16Precision) {
  const int64_t B = 1, hq = 4, hkv = 2, S = 64, D = 16;
  expect_ranks_succeed(4, [&](Group& world) {
    auto [ulysses, ring] = hybrid_groups(world, 1, 4);
    const RingLayout layout = RingLayout::make(S, 1, 4);
    at::Tensor Q = seeded_randn({B, S, hq, D}, 1), K = seeded_randn({B, S, hkv, D}, 2);
    at::Tensor V = seeded_randn({B, S, hkv, D}, 3);
    auto cut = [&](const at::Tensor& X) {
      return layout.shard(X, 1, world.rank()).to(at::kBFloat16).requires_grad_();
    };
    at::Tensor q = cut(Q), k = cut(K), v = cut(V);
    AttentionOptions opts;
    opts.causal = true;
    DistributedAttention attention(ulysses, ring, opts);
    at::Tensor o = attention(q, k, v);
    o.to(at::kFloat).sum().backward();
    LocalAttentionArgs ref;  // fp64, from the bf16-rounded inputs.
    at::Tensor Qr = Q.to(at::kBFloat16).to(at::kDouble).requires_grad_();
    at::Tensor Kr = K.to(at::kBFloat16).to(at::kDouble).requires_grad_();
    at::Tensor Vr = V.to(at::kBFloat16).to(at::kDouble).requires_grad_();
    ref.q = Qr.permute({0, 2, 1, 3}), ref.k = Kr.permute({0, 2, 1, 3});
    ref.v = Vr.permute({0, 2, 1, 3});
    ref.kv_map = {0, 0, 1, 1};
    ref.causal = true;
    at::Tensor O = math_attention(ref).permute({0, 2, 1, 3});
    O.sum().backward();
    auto shard = [&](const at::Tensor& X) { return layout.shard(X, 1, world.rank()); };
    EXPECT_LT(rel_error(o.to(at::kDouble), shard(O)), 1e-2) << "output";
    EXPECT_LT(rel_error(k.grad().to(at::kDouble), shard(Kr.grad())), 2e-2) << "dk";
    EXPECT_LT(rel_error(q.grad().to(at::kDouble), shard(Qr.grad())), 2e-2) << "dq";
  });
}

// The ring's backward reads the forward's output only as delta = rowsum(do * o), as the fused
// kernel's does: o's bytes go before the ring's steps run (seen from a hook after the node ran,
// before the engine releases it), unless the graph is retained for a second backward.
TEST(RingAttention, BackwardDropsTheOutputBeforeTheRingRunsUnlessRetained) {
  expect_ranks_succeed(2, [](Group& world) {
    const RingLayout layout = RingLayout::make(16, 1, 2);
    const at::Tensor kv = seeded_randn({1, 1, 8, 8}, 3 + world.rank());
    const at::Tensor w = seeded_randn({1, 2, 8, 8}, 5 + world.rank());
    std::vector<at::Tensor> grads;
    for (const bool retain : {false, true}) {
      at::Tensor q = seeded_randn({1, 2, 8, 8}, 1 + world.rank()).requires_grad_();
      LocalAttentionArgs args;
      args.q = q, args.k = kv, args.v = kv, args.kv_map = {0, 0}, args.causal = true;
      at::Tensor out = ring_attention(args, layout, at::Tensor(), world);
      const auto freed = testing::freed_when_its_node_ran(out);
      const at::Tensor loss = (out * w).sum();  // (Keeps w, not out.)
      out = at::Tensor();
      loss.backward({}, retain);
      EXPECT_EQ(*freed, !retain) << where(world, q);
      grads.push_back(q.grad().clone());
      if (!retain) continue;
      q.mutable_grad() = at::Tensor();
      loss.backward();
      EXPECT_TRUE(q.grad().equal(grads.back())) << where(world, q);
    }
    EXPECT_TRUE(grads[0].equal(grads[1])) << where(world, grads[0]);
  });
}

// Layers sharing a StepContext rebuild a mask, gather position ids and make document ids once.
TEST(RingAttention, StepContextSharesMasksAndDocumentsAcrossLayers) {
  const int U = 2, R = 2;
  const int64_t B = 2, S = 13, D = 8;
  expect_ranks_succeed(U * R, [&](Group& world) {
    auto [ulysses, ring] = hybrid_groups(world, U, R);
    const RingLayout layout = RingLayout::make(S, U, R);
    const int p = world.rank();
    at::Tensor x = layout.shard(seeded_randn({B, S, 4, D}, 1), 1, p);
    at::Tensor bias = layout.shard(seeded_randn({B, 1, S, S}, 2), 2, p).requires_grad_();
    AttentionOptions opts;
    opts.causal = true;
    DistributedAttention first(ulysses, ring, opts), second(ulysses, ring, opts);
    StepContext context(ulysses);
    AttentionInputs in;
    in.mask = bias;
    in.positions = layout.shard(packed_positions(B, S), 1, p);
    in.context = &context;
    at::Tensor a = first(x, x, x, in);
    EXPECT_EQ(context.reuses(), 0);
    at::Tensor b = second(x, x, x, in);
    EXPECT_EQ(context.reuses(), 3) << "mask, positions and document ids";
    EXPECT_TRUE(a.equal(b));
    in.context = nullptr;  // Without the context: the same values.
    EXPECT_TRUE(first(x, x, x, in).equal(a));
  });
}

// The planner's ring counts are what a layer sends: R-1 kv blocks forward, R-1 backward and R
// fp32 dk/dv accumulators.
TEST(RingAttention, StepsAndBytesMatchThePlanner) {
  const int U = 1, R = 4;
  const int64_t B = 1, hq = 4, hkv = 2, S = 32, D = 8;
  expect_ranks_succeed(U * R, [&](Group& world) {
    auto [ulysses, ring] = hybrid_groups(world, U, R);
    const RingLayout layout = RingLayout::make(S, U, R);
    at::Tensor q = layout.shard(seeded_randn({B, S, hq, D}, 1), 1, world.rank()).requires_grad_();
    at::Tensor k = layout.shard(seeded_randn({B, S, hkv, D}, 2), 1, world.rank()).requires_grad_();
    at::Tensor v = layout.shard(seeded_randn({B, S, hkv, D}, 3), 1, world.rank()).requires_grad_();
    AttentionOptions opts;
    opts.causal = true;
    DistributedAttention attention(ulysses, ring, opts);
    const int64_t bytes0 = ring.recorder().p2p_bytes(), messages0 = ring.recorder().p2p_messages();
    attention(q, k, v).sum().backward();
    LayerShape shape;
    shape.q_heads = hq, shape.kv_heads = hkv, shape.seq_len = S, shape.head_dim = D;
    for (const MeshCost& c : plan_sp_mesh(U * R, shape)) {
      if (c.ulysses != U) continue;
      EXPECT_EQ(ring.recorder().p2p_messages() - messages0, c.ring_messages) << where(world, q);
      EXPECT_EQ(ring.recorder().p2p_bytes() - bytes0, c.ring_bytes) << where(world, q);
    }
  });
}

TEST(RingAttention, BadMasksAndWrongLayoutsFailAlikeOnEveryRank) {
  // One rank's mask covers only its own keys (a key-sharded mask).
  auto errors = run_ranks(2, [](Group& world) {
    DistributedAttention attention(Group::solo(), world);
    at::Tensor x = at::randn({1, world.rank() == 0 ? 3 : 3, 2, 4});
    AttentionInputs in;
    in.mask = at::ones({1, 1, 3, world.rank() == 0 ? 3 : 6}, at::kBool);
    attention(x, x, x, in);
  });
  expect_ranks_fail_alike(errors, "its keys all 6 (in global order) or 1; ring rank 0's mask is");
  // On 2 x 2 ranks only rank 3's mask is wrong: its ring group refuses the call, and through
  // the Ulysses groups every rank raises the same error (none waits in an all-to-all).
  errors = run_ranks(4, [](Group& world) {
    auto [ulysses, ring] = hybrid_groups(world, 2, 2);
    DistributedAttention attention(ulysses, ring);
    const RingLayout layout = RingLayout::make(8, 2, 2);
    at::Tensor x = layout.shard(at::randn({1, 8, 2, 4}), 1, world.rank());
    AttentionInputs in;
    in.mask = at::ones({1, 1, x.size(1), world.rank() == 3 ? 5 : 8}, at::kBool);
    attention(x, x, x, in);
  });
  expect_ranks_fail_alike(errors, "ring rank 1's mask is [1, 1, 2, 5]");
  // A contiguous split where the zigzag layout is expected (rank 0 holds 4 tokens, not 3+... ).
  errors = run_ranks(2, [](Group& world) {
    DistributedAttention attention(Group::solo(), world);
    at::Tensor x = at::randn({1, world.rank() == 0 ? 5 : 3, 2, 4});
    attention(x, x, x);
  });
  expect_ranks_fail_alike(errors, "the zigzag layout of 8 tokens gives it 4");
}

TEST(Planner, PrefersFewestBytesAndListsEverySplit) {
  LayerShape shape;
  shape.q_heads = 32, shape.kv_heads = 8, shape.seq_len = 1 << 15, shape.head_dim = 128;
  const auto plans = plan_sp_mesh(16, shape);
  ASSERT_EQ(plans.size(), 5u);  // 1x16, 2x8, 4x4, 8x2, 16x1.
  for (size_t i = 1; i < plans.size(); ++i) {
    EXPECT_LE(plans[0].a2a_bytes + plans[0].ring_bytes, plans[i].a2a_bytes + plans[i].ring_bytes);
  }
  for (const MeshCost& c : plans) {
    EXPECT_EQ(c.kv_replicas, c.ulysses > 8 ? c.ulysses / 8 : 1) << c.describe();
    EXPECT_EQ(c.ring_messages, c.ring > 1 ? 3 * c.ring - 2 : 0) << c.describe();
    EXPECT_EQ(c.a2a_bytes == 0, c.ulysses == 1) << c.describe();
  }
  EXPECT_THROW(plan_sp_mesh(0, shape), c10::ValueError);
}

}  // namespace
}  // namespace ulysses
