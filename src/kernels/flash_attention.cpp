// The CPU flash-attention kernel. See flash_attention.h for the equations.
#include "ulysses/flash_attention.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/flash_kernel.h"
#include "kernels/gemm_bf16.h"
#include "kernels/ops.h"
#include "ulysses/mask_decision.h"

namespace ulysses {
namespace {

using detail::FlashGrads;
using Problem = detail::FlashProblem;

#if ULYSSES_FLASH_ISA_BUILDS
// Whether this CPU runs the instructions of the build for `isa` (its flags in CMakeLists.txt).
bool cpu_runs(const std::string& isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "AVX2") return avx2;
  return isa == "AVX512" && avx2 && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}
#endif

// The passes of the instruction set ATen runs on this CPU. ATEN_CPU_CAPABILITY may lower it,
// and may name more than the CPU has (ATen takes it as given): never above what the CPU runs.
const detail::FlashPasses& passes() {
  static const detail::FlashPasses chosen = [] {
#if ULYSSES_FLASH_ISA_BUILDS
    const std::string isa = at::get_cpu_capability();
    if (isa == "AVX512" && cpu_runs("AVX512")) return detail::AVX512::flash_passes();
    if ((isa == "AVX512" || isa == "AVX2") && cpu_runs("AVX2")) return detail::AVX2::flash_passes();
#endif
    return detail::DEFAULT::flash_passes();
  }();
  return chosen;
}

// bf16 inputs multiply in bf16 where the AVX512 passes run and the CPU has AVX512-BF16 (the
// bf16 GEMM, detail/gemm_bf16.h); every other input is read as fp32.
at::ScalarType kernel_dtype(const LocalAttentionArgs& a) {
  const bool bf16 = a.q.scalar_type() == at::kBFloat16 && a.k.scalar_type() == at::kBFloat16 &&
                    a.v.scalar_type() == at::kBFloat16;
  return bf16 && flash_attention_bf16_gemm() ? at::kBFloat16 : at::kFloat;
}

// Rows of `dtype` (kernel_dtype's) with a contiguous last dim and a BLAS-valid row stride, as
// the kernel reads them (a no-op for such BHSD tensors and for BSHD tensors viewed as BHSD).
at::Tensor as_kernel_input(const at::Tensor& t, at::ScalarType dtype) {
  at::Tensor f = t.scalar_type() == dtype ? t : t.to(dtype);
  const bool usable = f.stride(3) == 1 && f.stride(2) >= std::max<int64_t>(1, f.size(3));
  return usable ? f : f.contiguous();
}

// Shapes, dtypes, kv_map, window and tile sizes of a kernel call (before any work).
void check_problem(const LocalAttentionArgs& a, const FlashOptions& options) {
  check_window(a.window, a.causal);
  check_softcap(a.softcap);
  TORCH_CHECK_VALUE(a.q.dim() == 4 && a.k.dim() == 4 && a.v.dim() == 4,
                    "flash_attention: q, k, v must be 4-D BHSD; got ", a.q.sizes(), ", ",
                    a.k.sizes(), ", ", a.v.sizes());
  TORCH_CHECK_VALUE(a.k.size(0) == a.q.size(0) && a.v.size(0) == a.q.size(0) &&
                        a.k.size(1) == a.v.size(1) && a.k.size(2) == a.v.size(2) &&
                        a.k.size(3) == a.q.size(3),
                    "flash_attention: incompatible shapes q ", a.q.sizes(), ", k ", a.k.sizes(),
                    ", v ", a.v.sizes(), " (want q [B,Hq,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv])");
  TORCH_CHECK_TYPE(a.q.is_floating_point() && a.k.is_floating_point() && a.v.is_floating_point(),
                   "flash_attention: q, k, v must be floating point; got ", a.q.scalar_type(), ", ",
                   a.k.scalar_type(), ", ", a.v.scalar_type());
  for (const at::Tensor* t : {&a.q, &a.k, &a.v}) {
    TORCH_CHECK_VALUE(t->size(0) >= 1 && t->size(1) >= 1 && t->size(3) >= 1,
                      "flash_attention: batch, heads and head dim must be >= 1; got q ",
                      a.q.sizes(), ", k ", a.k.sizes(), ", v ", a.v.sizes());
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(a.kv_map.size()) == a.q.size(1),
                    "flash_attention: kv_map must have one entry per query head (", a.q.size(1),
                    "); got ", a.kv_map.size());
  for (int64_t g : a.kv_map)
    TORCH_CHECK_VALUE(g >= 0 && g < a.k.size(1), "flash_attention: kv_map entry ", g,
                      " is out of range for ", a.k.size(1), " kv heads");
  TORCH_CHECK_VALUE(options.block_q >= 0 && options.block_k >= 0,
                    "flash_attention: block sizes must be >= 1 (0: chosen by the kernel); got ",
                    options.block_q, ", ", options.block_k);
}

// The mask as the kernel reads it: bool `allowed` or float `bias`, expanded to
// [B, Hq, Sq, Sk].
void set_mask(Problem& p, const c10::optional<at::Tensor>& mask) {
  if (!mask) return;
  const std::vector<int64_t> full{p.B, p.Hq, p.Sq, p.Sk};
  if (mask->scalar_type() == at::kBool) {
    p.allowed = mask->expand(full);
  } else {
    TORCH_CHECK_TYPE(mask->is_floating_point(),
                     "flash_attention: mask must be bool or "
                     "floating point; got ",
                     mask->scalar_type());
    p.bias = mask->detach().to(at::kFloat).expand(full);
  }
}

// Global row indices (causal rule) and document ids (packed sequences) from `a.rows` or
// `a.positions`; 0..S-1 without either.
void set_rows(Problem& p, const LocalAttentionArgs& a) {
  TORCH_CHECK_VALUE(!(a.rows && a.positions),
                    "flash_attention: give either position ids or global rows, not both");
  auto rows_of = [](const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK_VALUE(t.numel() == n && !t.is_floating_point(), "flash_attention: ", what,
                      " must hold ", n, " integer indices; got ", t.sizes(), " ", t.scalar_type());
    return t.to(at::kLong).contiguous().view({n});
  };
  auto docs_of = [&](const at::Tensor& t, int64_t n, const char* what) {
    at::Tensor d = t.dim() == 1 ? t.unsqueeze(0) : t;
    TORCH_CHECK_VALUE(d.dim() == 2 && d.size(1) == n && (d.size(0) == 1 || d.size(0) == p.B),
                      "flash_attention: ", what, " must be [B or 1, ", n, "]; got ", t.sizes());
    return d.to(at::kLong).expand({p.B, n});
  };
  if (a.rows) {
    p.q_index = rows_of(a.rows->q_index, p.Sq, "rows.q_index");
    p.k_index = rows_of(a.rows->k_index, p.Sk, "rows.k_index");
    TORCH_CHECK_VALUE(a.rows->q_docs.defined() == a.rows->k_docs.defined(),
                      "flash_attention: give document ids for both queries and keys, or neither");
    if (a.rows->q_docs.defined()) {
      p.q_doc = docs_of(a.rows->q_docs, p.Sq, "rows.q_docs");
      p.k_doc = docs_of(a.rows->k_docs, p.Sk, "rows.k_docs");
    }
  } else {
    p.q_index = at::arange(p.Sq, at::kLong);
    p.k_index = p.Sq == p.Sk ? p.q_index : at::arange(p.Sk, at::kLong);
  }
  if (a.positions) {
    TORCH_CHECK_VALUE(a.positions->size(-1) == p.Sk && p.Sq == p.Sk,
                      "flash_attention: positions must cover the ", p.Sk,
                      " keys (with Sq == Sk); got ", a.positions->sizes());
    p.q_doc = p.k_doc = docs_of(document_ids(*a.positions), p.Sk, "positions");
  }
}

// The kernel's view of `a` (checked), with tile sizes from `options`.
Problem make_problem(const LocalAttentionArgs& a, const FlashOptions& options) {
  check_problem(a, options);
  Problem p;
  // Detached: the backward node keeps these, and must not keep autograd history alive.
  const at::ScalarType dtype = kernel_dtype(a);
  p.bf16 = dtype == at::kBFloat16;
  p.q = as_kernel_input(a.q, dtype).detach();
  p.k = as_kernel_input(a.k, dtype).detach();
  p.v = as_kernel_input(a.v, dtype).detach();
  p.B = a.q.size(0), p.Hq = a.q.size(1), p.Sq = a.q.size(2), p.D = a.q.size(3);
  p.Hkv = a.k.size(1), p.Sk = a.k.size(2), p.Dv = a.v.size(3);
  p.kv_map = a.kv_map;
  p.causal = a.causal;
  p.window = a.window;
  p.softcap = static_cast<float>(a.softcap);
  p.scale = static_cast<float>(a.scale > 0 ? a.scale : 1.0 / std::sqrt(static_cast<double>(p.D)));
  // Square tiles that shrink with short sequences, so the causal rule still skips most of
  // the upper triangle (one 256-row tile at S = 256 would compute all of it).
  p.bq = options.block_q > 0 ? options.block_q : p.Sq >= 2048 ? 256 : p.Sq >= 1024 ? 128 : 64;
  p.bk = options.block_k;
  if (p.bk == 0) {
    const int64_t fit = (int64_t{1} << 22) / (p.bq * std::max(p.D, p.Dv));
    p.bk = std::max<int64_t>(16, std::min<int64_t>(std::max<int64_t>(p.bq, 64), fit / 16 * 16));
  }
  set_mask(p, a.mask);
  set_rows(p, a);
  return p;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> flash_attention_forward(const LocalAttentionArgs& a,
                                                           const FlashOptions& options) {
  TORCH_CHECK_TYPE(a.q.scalar_type() != at::kDouble,
                   "flash_attention: the fused kernel computes fp32, bf16 and fp16 (in fp32); "
                   "for fp64 use local attention 'math' (ulysses.local_attention(..., "
                   "kernel=\"math\"), or 'auto', which picks it for fp64)");
  const Problem p = make_problem(a, options);
  at::NoGradGuard no_grad;
  auto [out, lse] = passes().forward(p);
  if (out.scalar_type() != a.q.scalar_type()) out = out.to(a.q.scalar_type());
  return {out, lse};
}

std::vector<at::Tensor> flash_attention_backward(const at::Tensor& grad_out,
                                                 const LocalAttentionArgs& a, const at::Tensor& out,
                                                 const at::Tensor& lse, bool mask_grad,
                                                 const FlashOptions& options) {
  at::NoGradGuard no_grad;
  return detail::flash_backward_from_delta(grad_out, a, detail::attention_delta(grad_out, out), lse,
                                           mask_grad, options);
}

std::vector<at::Tensor> detail::flash_backward_from_delta(const at::Tensor& grad_out,
                                                          const LocalAttentionArgs& a,
                                                          const at::Tensor& delta,
                                                          const at::Tensor& lse, bool mask_grad,
                                                          const FlashOptions& options) {
  TORCH_CHECK_VALUE(!mask_grad || (a.mask && a.mask->is_floating_point()),
                    "flash_attention_backward: a mask gradient needs a floating-point mask");
  const Problem p = make_problem(a, options);
  at::NoGradGuard no_grad;
  FlashGrads g = passes().backward(p, as_kernel_input(grad_out, p.q.scalar_type()),
                                   delta.contiguous(), lse, mask_grad);
  std::vector<at::Tensor> result{g.dq.to(a.q.scalar_type()), g.dk.to(a.k.scalar_type()),
                                 g.dv.to(a.v.scalar_type()), at::Tensor()};
  if (mask_grad) result[3] = g.dbias.sum_to_size(a.mask->sizes()).to(a.mask->scalar_type());
  return result;
}

std::string flash_attention_isa() { return passes().isa; }

bool flash_attention_bf16_gemm() {
  // Once: choose_local_kernel asks on every attention call.
  static const bool bf16_gemm = std::string(passes().isa) == "AVX512" && detail::has_bf16_gemm();
  return bf16_gemm;
}

at::Tensor flash_attention(const LocalAttentionArgs& a, const FlashOptions& options) {
  if (a.q.scalar_type() == at::kDouble) return math_attention(a);
  return std::get<0>(detail::call_flash_attention(a, options));
}

std::tuple<at::Tensor, at::Tensor> merge_attention(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                   const at::Tensor& out_b,
                                                   const at::Tensor& lse_b) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // Empty rows (+inf) weigh nothing; a shift by the larger lse keeps exp() in range and cancels
  // exactly (detached: the result does not depend on it).
  at::Tensor a = lse_a.masked_fill(lse_a.isposinf(), -kInf);
  at::Tensor b = lse_b.masked_fill(lse_b.isposinf(), -kInf);
  at::Tensor m = at::maximum(a, b).detach();
  m = m.masked_fill(m.isneginf(), 0);
  at::Tensor wa = (a - m).exp(), wb = (b - m).exp();
  at::Tensor sum = wa + wb;
  at::Tensor empty = sum.eq(0);
  at::Tensor safe = sum.masked_fill(empty, 1);
  at::Tensor out = out_a * (wa / safe).unsqueeze(-1) + out_b * (wb / safe).unsqueeze(-1);
  at::Tensor lse = (m + safe.log()).masked_fill(empty, kInf);
  return {out, lse};
}

}  // namespace ulysses
