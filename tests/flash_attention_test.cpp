// flash_attention against math_attention, forward and backward.
#include "ulysses/flash_attention.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <sstream>

#include "testing.h"

namespace ulysses {
namespace {

using testing::rel_error;

using testing::seeded_randn;

enum class MaskKind {
  kNone,
  kBoolB1SS,
  kBoolBHSS,
  kFloat11SS,
  kFloat2D,
  kBoolKeys,
  kFloatB11S,
  kLearnableB1SS,
  kLearnableHSS
};

struct Case {
  int64_t B, Hq, Hkv, S, D, Dv;
  bool causal = false;
  bool packed = false;
  MaskKind mask = MaskKind::kNone;
  std::vector<int64_t> kv_map = {};  // Empty: uniform GQA groups.
  at::ScalarType dtype = at::kFloat;
  FlashOptions blocks = {16, 32};
  int64_t window = 0;  // Sliding window (with causal); 0: none.
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "B" << c.B << "_Hq" << c.Hq << "_Hkv" << c.Hkv << "_S" << c.S << "_D" << c.D << "_Dv"
     << c.Dv << (c.causal ? "_causal" : "") << (c.packed ? "_packed" : "") << "_mask"
     << static_cast<int>(c.mask) << (c.kv_map.empty() ? "" : "_map") << "_"
     << c10::toString(c.dtype) << "_bq" << c.blocks.block_q << "_bk" << c.blocks.block_k
     << (c.window ? "_window" + std::to_string(c.window) : "");
  return os.str();
}
void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

class Flash : public ::testing::TestWithParam<Case> {};

TEST_P(Flash, MatchesMathAttentionForwardAndBackward) {
  const Case c = GetParam();
  const bool low = c.dtype != at::kFloat;
  at::Tensor q = seeded_randn({c.B, c.Hq, c.S, c.D}, 1).to(c.dtype);
  at::Tensor k = seeded_randn({c.B, c.Hkv, c.S, c.D}, 2).to(c.dtype);
  at::Tensor v = seeded_randn({c.B, c.Hkv, c.S, c.Dv}, 3).to(c.dtype);
  at::Tensor w = seeded_randn({c.B, c.Hq, c.S, c.Dv}, 4);
  c10::optional<at::Tensor> mask;
  const int64_t B = c.B, H = c.Hq, S = c.S;
  switch (c.mask) {
    case MaskKind::kNone:
      break;
    case MaskKind::kBoolB1SS:
      mask = seeded_randn({B, 1, S, S}, 5).gt(-0.5);
      break;
    case MaskKind::kBoolBHSS:
      mask = seeded_randn({B, H, S, S}, 5).gt(-0.3);
      break;
    case MaskKind::kFloat11SS:
      mask = seeded_randn({1, 1, S, S}, 5);
      break;
    case MaskKind::kFloat2D:
      mask = seeded_randn({S, S}, 5);
      break;
    case MaskKind::kBoolKeys:
      mask = seeded_randn({B, 1, 1, S}, 5).gt(-0.5);
      break;  // Padding.
    case MaskKind::kFloatB11S:
      mask = seeded_randn({B, 1, 1, S}, 5);
      break;
    case MaskKind::kLearnableB1SS:
      mask = seeded_randn({B, 1, S, S}, 5).requires_grad_();
      break;
    case MaskKind::kLearnableHSS:
      mask = seeded_randn({H, S, S}, 5).requires_grad_();
      break;
  }
  std::vector<int64_t> map = c.kv_map;
  if (map.empty())
    for (int64_t h = 0; h < c.Hq; ++h) map.push_back(h / (c.Hq / c.Hkv));
  c10::optional<at::Tensor> pos;
  if (c.packed) {
    at::Tensor p = at::empty({B, S}, at::kLong);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < S; ++i) p[b][i] = i % (7 + 5 * b);
    pos = p;
  }
  // The fp32 kernel is held to the math kernel in fp64 from the same inputs (an fp32 reference
  // differed by up to 3e-5 under load: its own rounding, not the kernel's).
  const at::ScalarType ref_dtype = low ? c.dtype : at::kDouble;
  auto run = [&](bool flash, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dm) {
    const at::ScalarType t = flash ? c.dtype : ref_dtype;
    auto leaf = [&](const at::Tensor& x) { return x.detach().to(t).clone().requires_grad_(); };
    at::Tensor qq = leaf(q), kk = leaf(k), vv = leaf(v);
    c10::optional<at::Tensor> mm;
    if (mask) {
      mm = mask->is_floating_point() ? mask->detach().to(flash ? at::kFloat : ref_dtype).clone()
                                     : *mask;
      if (mask->requires_grad()) mm->requires_grad_();
    }
    LocalAttentionArgs args{qq, kk, vv, map, mm, pos, c.causal, 0.0};
    args.window = c.window;
    at::Tensor o = flash ? flash_attention(args, c.blocks) : math_attention(args);
    EXPECT_EQ(o.scalar_type(), t);
    (o.to(w.scalar_type()) * w).sum().backward();
    dq = qq.grad(), dk = kk.grad(), dv = vv.grad();
    if (mm && mm->requires_grad()) dm = mm->grad();
    return o;
  };
  at::Tensor dq, dk, dv, dm, rq, rk, rv, rm;
  at::Tensor o = run(true, dq, dk, dv, dm);
  at::Tensor ref = run(false, rq, rk, rv, rm);
  const double tol = low ? 2e-2 : 2e-5;
  EXPECT_LT(rel_error(o, ref), tol) << "output";
  EXPECT_LT(rel_error(dq, rq, 1.0), 5 * tol) << "dq";
  EXPECT_LT(rel_error(dk, rk, 1.0), 5 * tol) << "dk";
  EXPECT_LT(rel_error(dv, rv, 1.0), 5 * tol) << "dv";
  if (rm.defined()) EXPECT_LT(rel_error(dm, rm, 1.0), 5 * tol) << "dmask";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int64_t D : {16, 64, 80, 128}) {
    out.push_back({1, 2, 2, 37, D, D});
    out.push_back({2, 4, 2, 50, D, D, true});
  }
  out.push_back({1, 1, 1, 1, 64, 64});  // S = 1.
  out.push_back({1, 1, 1, 1, 64, 64, true});
  out.push_back({2, 3, 3, 129, 32, 24});       // Dv != D, S one past a block.
  out.push_back({1, 4, 1, 70, 16, 16, true});  // MQA.
  out.push_back({1, 3, 2, 45, 16, 16, false, false, MaskKind::kNone, {1, 0, 1}});  // Any map.
  out.push_back({2, 4, 2, 61, 16, 16, true, true});   // Causal packed documents.
  out.push_back({2, 4, 2, 61, 16, 16, false, true});  // Packed, bidirectional.
  for (MaskKind m : {MaskKind::kBoolB1SS, MaskKind::kBoolBHSS, MaskKind::kFloat11SS,
                     MaskKind::kFloat2D, MaskKind::kBoolKeys, MaskKind::kFloatB11S,
                     MaskKind::kLearnableB1SS, MaskKind::kLearnableHSS}) {
    out.push_back({2, 4, 2, 41, 16, 16, false, false, m});
    out.push_back({2, 4, 2, 41, 16, 16, true, false, m});
  }
  out.push_back({1, 4, 2, 300, 64, 64, true, false, MaskKind::kNone, {}, at::kFloat, {64, 128}});
  out.push_back({2, 4, 2, 77, 64, 64, true, false, MaskKind::kNone, {}, at::kBFloat16});
  out.push_back({1, 2, 1, 77, 128, 128, false, false, MaskKind::kBoolKeys, {}, at::kBFloat16});
  out.push_back({1, 2, 2, 33, 64, 64, true, false, MaskKind::kNone, {}, at::kHalf});
  // Sliding windows of 1, S/3, S-1 and more than S tokens: whole tiles before a window are
  // skipped and the window's edge is cut within a tile, alone, with packed documents and masks.
  for (int64_t w : {1, 20, 60, 70}) {
    out.push_back({2, 4, 2, 61, 16, 16, true, false, MaskKind::kNone, {}, at::kFloat, {16, 32}, w});
    out.push_back({2, 4, 2, 61, 16, 16, true, true, MaskKind::kNone, {}, at::kFloat, {16, 32}, w});
  }
  out.push_back(
      {2, 4, 2, 61, 16, 16, true, false, MaskKind::kLearnableB1SS, {}, at::kFloat, {16, 32}, 20});
  out.push_back(
      {2, 4, 2, 61, 16, 16, true, false, MaskKind::kBoolKeys, {}, at::kFloat, {16, 32}, 7});
  out.push_back(
      {1, 4, 2, 300, 64, 64, true, false, MaskKind::kNone, {}, at::kFloat, {64, 128}, 100});
  out.push_back(
      {2, 4, 2, 77, 64, 48, true, false, MaskKind::kNone, {}, at::kBFloat16, {16, 32}, 30});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Sweep, Flash, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return describe(info.param); });

TEST(FlashAttention, ReadsStridedBshdViewsInPlace) {
  // BSHD tensors viewed as BHSD (as DistributedAttention passes them): no copy, same result.
  at::Tensor q = seeded_randn({2, 40, 4, 16}, 1).permute({0, 2, 1, 3});
  at::Tensor k = seeded_randn({2, 40, 2, 16}, 2).permute({0, 2, 1, 3});
  LocalAttentionArgs args{q, k, k, {0, 0, 1, 1}};
  // The reference in fp64: ATen's fp32 matmul here gave 2e-5 off its usual result in about one
  // process in ten (2 threads, this Intel host), whatever the kernel under test does.
  LocalAttentionArgs exact{q.to(at::kDouble), k.to(at::kDouble), k.to(at::kDouble), {0, 0, 1, 1}};
  EXPECT_LT(rel_error(flash_attention(args, {8, 16}), math_attention(exact)), 2e-6);
}

TEST(FlashAttention, BackwardReadsAStridedGradientInPlace) {
  // A head-sharded gradient arrives BSHD, viewed as BHSD: the same gradients as a contiguous one.
  at::Tensor q = seeded_randn({1, 3, 33, 16}, 1).requires_grad_(),
             k = seeded_randn({1, 1, 33, 16}, 2).requires_grad_();
  LocalAttentionArgs args{q, k, k, {0, 0, 0}, c10::nullopt, c10::nullopt, true};
  const at::Tensor g = seeded_randn({1, 33, 3, 16}, 3).permute({0, 2, 1, 3});
  ASSERT_FALSE(g.is_contiguous());
  const auto strided = torch::autograd::grad({flash_attention(args, {8, 16})}, {q, k}, {g});
  const auto packed =
      torch::autograd::grad({flash_attention(args, {8, 16})}, {q, k}, {g.contiguous()});
  EXPECT_TRUE(strided[0].equal(packed[0]) && strided[1].equal(packed[1]));
}

TEST(FlashAttention, SavedTensorsAreFreedOnceBackwardRan) {
  // Backward frees what the node keeps (q, k, v, out, lse) when it has run, as torch frees
  // saved variables, not when the graph dies; backward through it again is a clear error.
  at::Tensor q = seeded_randn({1, 2, 24, 16}, 1).requires_grad_(),
             k = seeded_randn({1, 1, 24, 16}, 2);
  LocalAttentionArgs args{q, k, k, {0, 0}, c10::nullopt, c10::nullopt, true};
  const auto before = q.storage().use_count();
  at::Tensor out = flash_attention(args, {8, 8});
  EXPECT_GT(q.storage().use_count(), before);
  out.sum().backward();
  EXPECT_EQ(q.storage().use_count(), before) << "the graph (out) lives on; q's copy is freed";
  try {
    out.sum().backward();
    ADD_FAILURE() << "a second backward ran";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("retain_graph=True"), std::string::npos) << e.what();
  }
  at::Tensor kept = flash_attention(args, {8, 8});
  kept.sum().backward({}, /*retain_graph=*/true);
  EXPECT_NO_THROW(kept.sum().backward());
}

TEST(FlashAttention, BackwardDropsTheOutputBeforeItsKernelUnlessRetained) {
  // Backward reads the forward's output only as rowsum(do * o): o's bytes go before the kernel
  // runs (seen from a hook after the node ran, before the engine releases the node), unless
  // the graph is retained, where a second backward needs o and gets the same gradients.
  const at::Tensor k = seeded_randn({1, 1, 24, 16}, 2), w = seeded_randn({1, 2, 24, 16}, 3);
  std::vector<at::Tensor> grads;
  for (const bool retain : {false, true}) {
    SCOPED_TRACE(retain ? "retained" : "not retained");
    at::Tensor q = seeded_randn({1, 2, 24, 16}, 1).requires_grad_();
    at::Tensor out = flash_attention({q, k, k, {0, 0}, c10::nullopt, c10::nullopt, true}, {8, 8});
    const auto freed = testing::freed_when_its_node_ran(out);
    const at::Tensor loss = (out * w).sum();  // (Keeps w, not out.)
    out = at::Tensor();
    loss.backward({}, retain);
    EXPECT_EQ(*freed, !retain);
    grads.push_back(q.grad().clone());
    if (!retain) continue;
    q.mutable_grad() = at::Tensor();
    loss.backward();
    EXPECT_TRUE(q.grad().equal(grads.back()));
  }
  EXPECT_TRUE(grads[0].equal(grads[1]));
}

TEST(FlashAttention, AWindowNeedsCausalAttention) {
  at::Tensor q = seeded_randn({1, 1, 8, 16}, 1);
  for (bool fused : {true, false}) {
    LocalAttentionArgs args{q, q, q, {0}, {}, {}, /*causal=*/false, 0.0};
    args.window = 4;
    EXPECT_THROW(
        {
          try {
            fused ? flash_attention(args) : math_attention(args);
          } catch (const c10::ValueError& e) {
            EXPECT_NE(std::string(e.what()).find("a sliding window is a causal rule: give window > "
                                                 "0 with causal=True"),
                      std::string::npos)
                << e.what();
            throw;
          }
        },
        c10::ValueError);
  }
}

TEST(FlashAttention, FullyMaskedRowsAreZero) {
  at::Tensor q = seeded_randn({1, 1, 4, 8}, 1), k = seeded_randn({1, 1, 4, 8}, 2);
  at::Tensor mask = at::ones({1, 1, 4, 4}, at::kBool);
  mask[0][0][2].fill_(false);
  at::Tensor o = flash_attention({q, k, k, {0}, mask});
  EXPECT_TRUE(o[0][0][2].eq(0).all().item<bool>());
  EXPECT_LT(rel_error(o, math_attention({q, k, k, {0}, mask})), 2e-5);
}

TEST(FlashAttention, SinksMatchMathAttentionWithTheirGradient) {
  // gpt-oss's attention sinks, causal with a fully masked row: forward, dq and dsinks.
  for (bool causal : {false, true}) {
    at::Tensor q = seeded_randn({2, 4, 37, 16}, 1).requires_grad_();
    at::Tensor k = seeded_randn({2, 2, 37, 16}, 2), v = seeded_randn({2, 2, 37, 8}, 3);
    at::Tensor sinks = (seeded_randn({4}, 4) + 1.0).requires_grad_();
    at::Tensor mask = at::ones({1, 1, 37, 37}, at::kBool);
    mask[0][0][5].fill_(false);
    LocalAttentionArgs args{q, k, v, {0, 0, 1, 1}, mask, {}, causal, 0.0};
    args.sinks = sinks;
    at::Tensor fused = flash_attention(args, {16, 8}), math = math_attention(args);
    EXPECT_LT(rel_error(fused, math), 2e-5);
    EXPECT_TRUE(fused[0][0][5].eq(0).all().item<bool>());
    args.sinks.reset();
    EXPECT_GT(rel_error(math_attention(args), math), 1e-2);  // The sinks matter.
    at::Tensor dO = seeded_randn(fused.sizes().vec(), 5);
    auto grads = [&](const at::Tensor& o) {
      q.mutable_grad().reset();
      sinks.mutable_grad().reset();
      o.backward(dO);
      return std::vector<at::Tensor>{q.grad().clone(), sinks.grad().clone()};
    };
    auto gf = grads(fused), gm = grads(math);
    EXPECT_LT(rel_error(gf[0], gm[0]), 1e-4);
    EXPECT_LT(rel_error(gf[1], gm[1]), 1e-4);
  }
}

// bf16 inputs against the fp64 math kernel on the same values. Where the CPU has AVX512-BF16
// every tile GEMM multiplies in bf16 (fp32 accumulation, softmax statistics in fp32), so the
// error is bf16's rounding of the probabilities, their gradients and the output (~2e-3
// relative); elsewhere the kernel computes in fp32. Tolerance 1e-2, forward and backward, with
// documents, masks (a learnable one included), windows and an uneven kv map, on several tiles.
TEST(FlashBf16, MatchesFp64WithMasksAndDocuments) {
  const int64_t B = 2, H = 4, S = 150, D = 64;
  at::Tensor pos = at::arange(S, at::kLong).remainder(47).expand({B, S}).contiguous();
  struct Case {
    const char* name;
    bool causal = false, packed = false;
    int64_t window = 0;
    int mask = 0;  // 0 none, 1 bool [B, 1, S, S], 2 learnable float [B, 1, S, S].
    std::vector<int64_t> kv_map = {0, 0, 1, 1};
  };
  for (const Case& c :
       {Case{"causal", true}, Case{"documents", true, true},
        Case{"bidirectional documents", false, true}, Case{"bool mask", false, false, 0, 1},
        Case{"learnable mask", true, false, 0, 2}, Case{"window", true, false, 40},
        Case{"uneven kv map", true, true, 0, 0, {1, 0, 0, 1}}}) {
    std::vector<at::Tensor> got, want;
    for (const at::ScalarType t : {at::kBFloat16, at::kDouble}) {
      auto leaf = [&](std::vector<int64_t> shape, uint64_t seed) {
        return seeded_randn(shape, seed).to(at::kBFloat16).to(t).requires_grad_();
      };
      at::Tensor q = leaf({B, H, S, D}, 1), k = leaf({B, 2, S, D}, 2), v = leaf({B, 2, S, D}, 3);
      c10::optional<at::Tensor> mask;
      if (c.mask == 1) mask = seeded_randn({B, 1, S, S}, 5).gt(-0.7);
      if (c.mask == 2) {
        mask = seeded_randn({B, 1, S, S}, 5).to(t == at::kDouble ? at::kDouble : at::kFloat);
        mask->requires_grad_();
      }
      LocalAttentionArgs a{q,        k,    v,
                           c.kv_map, mask, c.packed ? c10::optional<at::Tensor>(pos) : c10::nullopt,
                           c.causal, 0.0};
      a.window = c.window;
      at::Tensor o = t == at::kDouble ? math_attention(a) : flash_attention(a, {64, 64});
      (o.to(at::kDouble) * seeded_randn(o.sizes(), 6).to(at::kDouble)).sum().backward();
      auto& into = t == at::kDouble ? want : got;
      into = {o, q.grad(), k.grad(), v.grad()};
      if (c.mask == 2) into.push_back(mask->grad());
    }
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LT(rel_error(got[i].to(at::kDouble), want[i]), 1e-2)
          << c.name << " output/grad " << i << " (bf16 GEMM: " << flash_attention_bf16_gemm()
          << ")";
    }
  }
}

TEST(FlashAttention, MultiThreadedMatchesSingleThreaded) {
  const int threads = at::get_num_threads();
  at::Tensor q = seeded_randn({1, 4, 90, 16}, 1).requires_grad_(),
             k = seeded_randn({1, 1, 90, 16}, 2);
  LocalAttentionArgs args{q, k, k, {0, 0, 0, 0}, c10::nullopt, c10::nullopt, true};
  at::set_num_threads(1);
  at::Tensor a = flash_attention(args, {16, 16});
  a.sum().backward();
  at::Tensor ga = q.grad().clone();
  q.mutable_grad().reset();
  at::set_num_threads(std::max(2, threads));
  at::Tensor b = flash_attention(args, {16, 16});
  b.sum().backward();
  at::set_num_threads(threads);
  EXPECT_LT(rel_error(b, a), 1e-6);
  EXPECT_LT(rel_error(q.grad(), ga), 1e-5);
}

}  // namespace
}  // namespace ulysses
