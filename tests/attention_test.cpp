// The local attention reference (math_attention).
#include "ulysses/attention.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>

#include "testing.h"
#include "ulysses/flash_attention.h"

namespace ulysses {
namespace {

using testing::seeded_randn;

// Straightforward per-head loops, written independently of math_attention.
at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::vector<int64_t>& kv_map, const at::Tensor& allowed,
                           const at::Tensor& bias) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2);
  at::Tensor out = at::zeros({B, H, S, v.size(3)}, at::kDouble);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < S; ++i) {
        at::Tensor s = (k[b][kv_map[h]].to(at::kDouble).matmul(q[b][h][i].to(at::kDouble))) /
                           std::sqrt(static_cast<double>(q.size(3))) +
                       bias[b][h][i].to(at::kDouble);
        at::Tensor ok = allowed[b][h][i];
        if (!ok.any().item<bool>()) continue;
        s = s.masked_fill(ok.logical_not(), -INFINITY);
        out[b][h][i] = at::softmax(s, 0).matmul(v[b][kv_map[h]].to(at::kDouble));
      }
  return out;
}

TEST(MathAttention, MatchesNaiveLoopsWithGqaMaskCausalAndDocuments) {
  const int64_t B = 2, H = 3, Hkv = 2, S = 7, D = 5;
  at::Tensor q = seeded_randn({B, H, S, D}, 1), k = seeded_randn({B, Hkv, S, D}, 2),
             v = seeded_randn({B, Hkv, S, 4}, 3);
  std::vector<int64_t> kv_map{1, 0, 1};  // A non-uniform head map.
  at::Tensor mask = seeded_randn({B, 1, S, S}, 4).gt(-0.8);
  at::Tensor bias = seeded_randn({1, H, S, S}, 5);
  at::Tensor pos = at::tensor({0, 1, 2, 0, 1, 2, 3}, at::kLong);
  at::Tensor doc = document_ids(pos);
  EXPECT_TRUE(doc.equal(at::tensor({0, 0, 0, 1, 1, 1, 1}, at::kLong)));
  at::Tensor same_doc = doc.unsqueeze(1).eq(doc.unsqueeze(0));
  at::Tensor causal = at::ones({S, S}, at::kBool).tril();

  LocalAttentionArgs a{q, k, v, kv_map, mask, pos, true, 0.0};
  at::Tensor allowed = mask.logical_and(causal).logical_and(same_doc).expand({B, H, S, S});
  EXPECT_LT(testing::rel_error(math_attention(a),
                               naive_attention(q, k, v, kv_map, allowed, at::zeros({B, H, S, S}))),
            1e-5);
  a.mask = bias;
  a.positions = c10::nullopt;
  a.causal = false;
  EXPECT_LT(testing::rel_error(math_attention(a),
                               naive_attention(q, k, v, kv_map, at::ones({B, H, S, S}, at::kBool),
                                               bias.expand({B, H, S, S}))),
            1e-5);
}

TEST(MathAttention, FullyMaskedRowsGiveZerosAndFiniteGradients) {
  at::Tensor q = seeded_randn({1, 1, 3, 4}, 1).requires_grad_();
  at::Tensor k = seeded_randn({1, 1, 3, 4}, 2).requires_grad_(), v = seeded_randn({1, 1, 3, 4}, 3);
  at::Tensor mask =
      at::tensor({1, 1, 1, 0, 0, 0, 1, 0, 1}, at::kLong).view({1, 1, 3, 3}).to(at::kBool);
  at::Tensor o = math_attention({q, k, v, {0}, mask, c10::nullopt, false, 0.0});
  EXPECT_TRUE(o[0][0][1].eq(0).all().item<bool>());
  o.sum().backward();
  EXPECT_TRUE(q.grad().isfinite().all().item<bool>());
  EXPECT_TRUE(k.grad().isfinite().all().item<bool>());
}

// Note [Local attention by case], case by case: the kernel "auto" picks, and its result (value
// and q/k/v gradients) against the math kernel in fp64 on the same inputs.
TEST(LocalKernelRule, EachCaseRunsWhereTheRuleSaysAndExactly) {
  const int64_t B = 1, H = 4, Hkv = 2, S = 9, D = 8;
  at::Tensor pos = at::tensor({0, 1, 2, 3, 0, 1, 2, 0, 1}, at::kLong);
  at::Tensor mask = seeded_randn({1, 1, S, S}, 4).gt(-0.8);
  at::Tensor sinks = seeded_randn({H}, 5);
  struct Case {
    const char* name;
    std::function<void(LocalAttentionArgs&)> set;
    // Where bf16 runs on a CPU without AVX512-BF16; everything else (fp32, fp16, and bf16 where
    // the fused kernel multiplies in bf16) runs on the fused kernel, fp64 on math.
    LocalKernel bf16;
    std::vector<int64_t> kv_map = {0, 0, 1, 1};
  };
  const std::vector<Case> cases = {
      {"plain", [](LocalAttentionArgs&) {}, LocalKernel::kSdpa},
      {"causal", [](LocalAttentionArgs& a) { a.causal = true; }, LocalKernel::kSdpa},
      {"causal, uneven kv map",
       [](LocalAttentionArgs& a) { a.causal = true; },
       LocalKernel::kSdpa,
       {1, 0, 1, 1}},
      {"documents", [&](LocalAttentionArgs& a) { a.positions = pos, a.causal = true; },
       LocalKernel::kFused},
      {"window", [](LocalAttentionArgs& a) { a.causal = true, a.window = 3; }, LocalKernel::kFused},
      {"mask", [&](LocalAttentionArgs& a) { a.mask = mask; }, LocalKernel::kFused},
      {"softcap", [](LocalAttentionArgs& a) { a.softcap = 2.0; }, LocalKernel::kFused},
      {"sinks", [&](LocalAttentionArgs& a) { a.sinks = sinks; }, LocalKernel::kFused},
  };
  // Relative error against the fp64 reference: each dtype's rounding of q, k, v and the output.
  const std::map<at::ScalarType, double> tolerance = {
      {at::kFloat, 1e-5}, {at::kDouble, 1e-12}, {at::kHalf, 5e-3}, {at::kBFloat16, 3e-2}};
  for (const Case& c : cases) {
    for (const auto& [dtype, tol] : tolerance) {
      std::vector<at::Tensor> ours, ref;
      for (const bool reference : {false, true}) {
        const at::ScalarType t = reference ? at::kDouble : dtype;
        at::Tensor q = seeded_randn({B, H, S, D}, 1).to(t).requires_grad_();
        at::Tensor k = seeded_randn({B, Hkv, S, D}, 2).to(t).requires_grad_();
        at::Tensor v = seeded_randn({B, Hkv, S, D}, 3).to(t).requires_grad_();
        LocalAttentionArgs a{q, k, v, c.kv_map, c10::nullopt, c10::nullopt, false, 0.0};
        c.set(a);
        if (a.sinks) a.sinks = a.sinks->to(t);
        if (!reference) {
          const LocalKernel want = dtype == at::kDouble ? LocalKernel::kMath
                                   : dtype == at::kBFloat16 && !flash_attention_bf16_gemm()
                                       ? c.bf16
                                       : LocalKernel::kFused;
          EXPECT_EQ(to_string(choose_local_kernel(a, LocalKernel::kAuto)), to_string(want))
              << c.name << " " << dtype;
        }
        at::Tensor o = local_attention(a, reference ? LocalKernel::kMath : LocalKernel::kAuto);
        (o * seeded_randn(o.sizes(), 6).to(t)).sum().backward();
        auto& into = reference ? ref : ours;
        into = {o, q.grad(), k.grad(), v.grad()};
      }
      for (size_t i = 0; i < ours.size(); ++i) {
        EXPECT_LT(testing::rel_error(ours[i].to(at::kDouble), ref[i]), tol)
            << c.name << " " << dtype << " output/grad " << i;
      }
    }
  }
}

// The rule off the CPU, from facts alone (no device needed): on CUDA SDPA for a plain case and
// FlexAttention for every rule, which C++ runs on SDPA with a dense mask, or on math for a
// softcap or sinks; elsewhere SDPA, or math for a softcap or sinks. Each with its S x S buffer.
TEST(LocalKernelRule, OffTheCpuEveryCaseHasOneKernelForPythonAndOneForCpp) {
  struct Case {
    const char* name;
    std::function<void(KernelCase&)> set;
    LocalKernel cuda, cuda_cpp, other;
    SquareBuffer cuda_square, other_square;
  };
  using K = LocalKernel;
  using B = SquareBuffer;
  const std::vector<Case> cases = {
      {"plain", [](KernelCase&) {}, K::kSdpa, K::kSdpa, K::kSdpa, B::kNone, B::kNone},
      {"mask", [](KernelCase& c) { c.mask = true; }, K::kFlex, K::kSdpa, K::kSdpa, B::kNone,
       B::kNone},
      {"documents", [](KernelCase& c) { c.documents = true; }, K::kFlex, K::kSdpa, K::kSdpa,
       B::kRuleMask, B::kRuleMask},
      {"window", [](KernelCase& c) { c.window = 4; }, K::kFlex, K::kSdpa, K::kSdpa, B::kRuleMask,
       B::kRuleMask},
      {"softcap", [](KernelCase& c) { c.softcap = 2.0; }, K::kFlex, K::kMath, K::kMath, B::kScores,
       B::kScores},
      {"sinks", [](KernelCase& c) { c.sinks = true; }, K::kFlex, K::kMath, K::kMath, B::kScores,
       B::kScores},
  };
  for (const Case& c : cases) {
    KernelCase cuda, other, cpu;
    cuda.device = c10::DeviceType::CUDA;
    other.device = c10::DeviceType::Meta;
    for (KernelCase* k : {&cuda, &other, &cpu}) c.set(*k);
    EXPECT_EQ(to_string(choose_local_kernel(cuda, K::kAuto)), to_string(c.cuda)) << c.name;
    EXPECT_EQ(to_string(kernel_run_by_cpp(c.cuda, cuda)), to_string(c.cuda_cpp)) << c.name;
    EXPECT_EQ(to_string(choose_local_kernel(other, K::kAuto)), to_string(c.other)) << c.name;
    EXPECT_EQ(square_buffer_off_cpu(cuda, K::kAuto), c.cuda_square) << c.name;
    EXPECT_EQ(square_buffer_off_cpu(other, K::kAuto), c.other_square) << c.name;
    EXPECT_EQ(square_buffer_off_cpu(cpu, K::kAuto), B::kNone) << c.name;
    // Flex asked for by name: Python runs it; on the CPU C++ runs the fused kernel instead.
    EXPECT_EQ(to_string(kernel_run_by_cpp(choose_local_kernel(cpu, K::kFlex), cpu)), "fused");
  }
  EXPECT_EQ(parse_local_kernel("flex"), K::kFlex);
  KernelCase cuda;
  cuda.device = c10::DeviceType::CUDA;
  EXPECT_THROW(choose_local_kernel(cuda, K::kFused), c10::ValueError);  // CPU-only
}

}  // namespace
}  // namespace ulysses
