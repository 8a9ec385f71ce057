// The fused kernel's forward and backward passes (see flash_attention.h for the equations and
// detail/flash_kernel.h for how this file is built once per instruction set). Every elementwise
// loop is written in at::vec::Vectorized, so each build runs in its own vector width.
#include "kernels/flash_kernel.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/gemm_bf16.h"

#ifndef CPU_CAPABILITY
#error "flash_kernel.cpp is compiled with CPU_CAPABILITY set to DEFAULT, AVX2 or AVX512"
#endif

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc);

namespace ulysses::detail {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Row-major C[M, N] = alpha * op(A) * op(B) + beta * C, through the BLAS inside libtorch_cpu
// (the PyTorch wheel links MKL statically and exports its Fortran `sgemm_`; its own cpublas
// wrapper is not exported). Never a system BLAS: see docs/DESIGN.md on OpenBLAS mis-detecting
// this CPU. A row-major matrix is its transpose in BLAS's column-major view, hence the swapped
// operands.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

// The tile GEMMs of one thread: sgemm when both operands are fp32, else the bf16 GEMM (fp32
// operands, the probabilities and their gradients, rounded to bf16), with its packing scratch.
struct TileGemm {
  std::vector<uint32_t> scratch;

  template <typename TA, typename TB>
  void operator()(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const TA* A, int64_t lda, const TB* B, int64_t ldb, float beta, float* C,
                  int64_t ldc) {
    if constexpr (std::is_same_v<TA, float> && std::is_same_v<TB, float>) {
      gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    } else {
      const auto need = static_cast<size_t>(gemm_bf16_scratch(M, N, K));
      if (scratch.size() < need) scratch.resize(need);
      gemm_bf16(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, scratch.data());
    }
  }
};

// exp(x) to ~2 ulp for x in [-87, 88]; exactly 0 below (-inf gives 0) and NaN stays NaN. The
// softmax's hot loop: at::vec's own exp is a call into Sleef per vector, and its exp_u20 loses
// NaN (the clamp drops it).
inline Vec vexp(const Vec& x) {
  const Vec xc = at::vec::minimum(at::vec::maximum(x, Vec(-87.0f)), Vec(88.0f));
  const Vec n = at::vec::fmadd(xc, Vec(1.44269504088896341f), Vec(0.5f)).floor();
  Vec r = at::vec::fnmadd(n, Vec(0.693145751953125f), xc);
  r = at::vec::fnmadd(n, Vec(1.42860682030941723212e-6f), r);
  Vec p = at::vec::fmadd(Vec(1.9875691500e-4f), r, Vec(1.3981999507e-3f));
  p = at::vec::fmadd(p, r, Vec(8.3334519073e-3f));
  p = at::vec::fmadd(p, r, Vec(4.1665795894e-2f));
  p = at::vec::fmadd(p, r, Vec(1.6666665459e-1f));
  p = at::vec::fmadd(p, r, Vec(5.0000001201e-1f));
  p = at::vec::fmadd(p * r, r, r) + Vec(1.0f);
  using IVec = at::vec::Vectorized<int32_t>;
  const IVec bits = (at::vec::convert_to_int_of_same_size(n) + IVec(127)) << IVec(23);
  const Vec e = p * at::vec::cast<float>(bits);
  return Vec::blendv(e, Vec(0.0f), x < Vec(-87.0f));
}

// row[c] = exp(row[c] - shift) for c < n; returns their sum.
float exp_shifted(float* row, int64_t n, float shift) {
  const Vec sh(shift);
  Vec sum(0.0f);
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    const Vec e = vexp(Vec::loadu(row + c) - sh);
    e.store(row + c);
    sum += e;
  }
  if (c < n) {
    const Vec e = vexp(Vec::loadu(row + c, n - c) - sh);
    e.store(row + c, n - c);
    sum += Vec::set(Vec(0.0f), e, n - c);
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
}

// The row's maximum; NaN if any entry is NaN.
float row_max(const float* row, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, n);
}

void scale_row(float* row, int64_t n, float factor) {
  at::vec::map([factor](Vec x) { return x * Vec(factor); }, row, row, n);
}

// A 4-D fp32 or bf16 tensor whose last dim is contiguous, as strides for pointer arithmetic.
template <typename T>
struct Strided {
  const T* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  const T* at(int64_t i0, int64_t i1, int64_t i2) const {
    return data + i0 * s0 + i1 * s1 + i2 * s2;
  }
};

template <typename T>
Strided<T> strided(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.scalar_type() == c10::CppTypeToScalarType<T>::value && t.stride(3) == 1);
  return {t.data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2)};
}

// Caps the scores of tile s (rows x cols, leading dim lds): s = softcap * tanh(s / softcap).
// With `slope`, also stores d(capped)/ds = 1 - (capped / softcap)^2 there (the backward's).
void cap_tile(const FlashProblem& p, int64_t rows, int64_t cols, float* s, int64_t lds,
              float* slope = nullptr) {
  const float c = p.softcap, inv = 1.0f / p.softcap;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * lds;
    at::vec::map([c, inv](Vec x) { return (x * Vec(inv)).tanh() * Vec(c); }, row, row, cols);
    if (slope) {
      at::vec::map([inv](Vec x) { return Vec(1.0f) - (x * Vec(inv)) * (x * Vec(inv)); },
                   slope + r * lds, row, cols);
    }
  }
}

// Adds the bias and sets disallowed entries of tile s (rows x cols, leading dim lds) to -inf.
void mask_tile(const FlashProblem& p, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
               int64_t cols, float* s, int64_t lds) {
  const int64_t* qidx = p.qi();
  const int64_t* kidx = p.ki() + j0;
  const bool diagonal = p.causal && kidx[cols - 1] > qidx[i0];
  const bool window_edge = p.window > 0 && kidx[0] <= qidx[i0 + rows - 1] - p.window;
  const bool docs = p.q_doc.defined();
  const int64_t* dq = docs ? p.q_doc.data_ptr<int64_t>() + b * p.q_doc.stride(0) : nullptr;
  const int64_t* dk = docs ? p.k_doc.data_ptr<int64_t>() + b * p.k_doc.stride(0) : nullptr;
  const int64_t sq = docs ? p.q_doc.stride(1) : 0, sk = docs ? p.k_doc.stride(1) : 0;
  const bool mixed_docs =
      docs && !(dq[i0 * sq] == dq[(i0 + rows - 1) * sq] &&
                dk[j0 * sk] == dk[(j0 + cols - 1) * sk] && dq[i0 * sq] == dk[j0 * sk]);
  if (!p.bias.defined() && !p.allowed.defined() && !diagonal && !window_edge && !mixed_docs) {
    return;  // An interior tile: nothing to add or hide.
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    float* row = s + r * lds;
    if (p.bias.defined()) {
      const at::Tensor& t = p.bias;
      const float* bp = t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1) + i * t.stride(2) +
                        j0 * t.stride(3);
      const int64_t st = t.stride(3);
      if (st == 1) {
        at::vec::map2([](Vec x, Vec y) { return x + y; }, row, row, bp, cols);
      } else {
        for (int64_t c = 0; c < cols; ++c) row[c] += bp[c * st];
      }
    }
    if (p.allowed.defined()) {
      const at::Tensor& t = p.allowed;
      const bool* ap = t.data_ptr<bool>() + b * t.stride(0) + h * t.stride(1) + i * t.stride(2) +
                       j0 * t.stride(3);
      const int64_t st = t.stride(3);
      for (int64_t c = 0; c < cols; ++c)
        if (!ap[c * st]) row[c] = kNegInf;
    }
    if (diagonal) {  // Keys after query i: from the first index above q_index[i] on.
      const int64_t first = std::upper_bound(kidx, kidx + cols, qidx[i]) - kidx;
      std::fill(row + first, row + cols, kNegInf);
    }
    if (window_edge) {  // Keys out of query i's window: those up to q_index[i] - window.
      const int64_t past = std::upper_bound(kidx, kidx + cols, qidx[i] - p.window) - kidx;
      std::fill(row, row + past, kNegInf);
    }
    if (mixed_docs) {
      const int64_t di = dq[i * sq];
      for (int64_t c = 0; c < cols; ++c)
        if (dk[(j0 + c) * sk] != di) row[c] = kNegInf;
    }
  }
}

template <typename T>
std::pair<at::Tensor, at::Tensor> forward(const FlashProblem& p) {
  const auto f32 = p.q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({p.B, p.Hq, p.Sq, p.Dv}, f32);
  at::Tensor lse = at::empty({p.B, p.Hq, p.Sq}, f32);
  const auto q = strided<T>(p.q), k = strided<T>(p.k), v = strided<T>(p.v);
  const int64_t n_qb = (p.Sq + p.bq - 1) / p.bq;
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  at::parallel_for(0, p.B * p.Hq * n_qb, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(p.bq * p.bk), acc(p.bq * p.Dv), m(p.bq), l(p.bq);
    TileGemm gemm;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % n_qb, h = (task / n_qb) % p.Hq, b = task / (n_qb * p.Hq);
      const int64_t i0 = qb * p.bq, rows = std::min(p.bq, p.Sq - i0);
      const int64_t g = p.kv_map[h];
      const T* Q = q.at(b, h, i0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.0f);
      // Keys up to the last one the tile's last query may see (all when not causal).
      const int64_t j_end =
          p.causal ? std::upper_bound(p.ki(), p.ki() + p.Sk, p.qi()[i0 + rows - 1]) - p.ki() : p.Sk;
      for (int64_t j0 = 0; j0 < j_end; j0 += p.bk) {
        const int64_t cols = std::min(p.bk, j_end - j0);
        if (p.skip(b, i0, rows, j0, cols)) continue;
        gemm(false, true, rows, cols, p.D, p.scale, Q, q.s2, k.at(b, g, j0), k.s2, 0.0f, s.data(),
             p.bk);
        if (p.softcap > 0) cap_tile(p, rows, cols, s.data(), p.bk);
        mask_tile(p, b, h, i0, rows, j0, cols, s.data(), p.bk);
        for (int64_t r = 0; r < rows; ++r) {
          float* row = s.data() + r * p.bk;
          // NaN propagates (as in the math reference): std::max would drop it.
          const float row_m = row_max(row, cols);
          const float m_new = std::isnan(row_m) ? row_m : std::max(m[r], row_m);
          if (m_new == kNegInf) {  // Nothing allowed yet in this row.
            std::fill(row, row + cols, 0.0f);
            continue;
          }
          const float alpha = std::exp(m[r] - m_new);
          l[r] = l[r] * alpha + exp_shifted(row, cols, m_new);
          if (alpha != 1.0f) scale_row(acc.data() + r * p.Dv, p.Dv, alpha);
          m[r] = m_new;
        }
        gemm(false, false, rows, p.Dv, cols, 1.0f, s.data(), p.bk, v.at(b, g, j0), v.s2, 1.0f,
             acc.data(), p.Dv);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out_p + ((b * p.Hq + h) * p.Sq + i0 + r) * p.Dv;
        // l == 0: no allowed key, o = 0. l NaN: a NaN input, which o and lse carry on.
        const bool nan = std::isnan(l[r]);
        const float inv = l[r] > 0 || nan ? 1.0f / l[r] : 0.0f;
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, o, acc.data() + r * p.Dv, p.Dv);
        lse_p[(b * p.Hq + h) * p.Sq + i0 + r] = nan        ? l[r]
                                                : l[r] > 0 ? m[r] + std::log(l[r])
                                                           : kInf;
      }
    }
  });
  return {out, lse};
}

// Tasks own (batch, kv head, key blocks kb = c mod C): dk and dv of their key blocks and, when
// C == 1, dq of the kv head's query heads, so no two tasks write the same memory.
template <typename T>
FlashGrads backward(const FlashProblem& p, const at::Tensor& d_out, const at::Tensor& delta,
                    const at::Tensor& lse, bool want_dbias) {
  const auto q = strided<T>(p.q), k = strided<T>(p.k), v = strided<T>(p.v);
  const auto f32 = p.q.options().dtype(at::kFloat);
  const int64_t n_qb = (p.Sq + p.bq - 1) / p.bq, n_kb = (p.Sk + p.bk - 1) / p.bk;
  const int64_t threads = at::get_num_threads();
  const int64_t chunks =
      std::max<int64_t>(1, std::min(n_kb, (threads + p.B * p.Hkv - 1) / (p.B * p.Hkv)));
  at::Tensor dq_parts = at::zeros({chunks, p.B, p.Hq, p.Sq, p.D}, f32);
  FlashGrads g;
  g.dk = at::empty({p.B, p.Hkv, p.Sk, p.D}, f32);
  g.dv = at::empty({p.B, p.Hkv, p.Sk, p.Dv}, f32);
  if (want_dbias) g.dbias = at::zeros({p.B, p.Hq, p.Sq, p.Sk}, f32);
  const auto dO = strided<T>(d_out);
  const float* lse_p = lse.data_ptr<float>();
  const float* delta_p = delta.data_ptr<float>();
  at::parallel_for(0, p.B * p.Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(p.bq * p.bk), dp(p.bq * p.bk), dk(p.bk * p.D), dv(p.bk * p.Dv);
    std::vector<float> slope(p.softcap > 0 ? p.bq * p.bk : 0);  // d(capped score)/d(score).
    TileGemm gemm;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task % chunks, kvh = (task / chunks) % p.Hkv, b = task / (chunks * p.Hkv);
      float* dq_base = dq_parts.data_ptr<float>() + c * p.B * p.Hq * p.Sq * p.D;
      for (int64_t kb = c; kb < n_kb; kb += chunks) {
        const int64_t j0 = kb * p.bk, cols = std::min(p.bk, p.Sk - j0);
        const T* K = k.at(b, kvh, j0);
        const T* V = v.at(b, kvh, j0);
        std::fill(dk.begin(), dk.end(), 0.0f);
        std::fill(dv.begin(), dv.end(), 0.0f);
        for (int64_t h = 0; h < p.Hq; ++h) {
          if (p.kv_map[h] != kvh) continue;
          const int64_t bh = b * p.Hq + h;
          for (int64_t qb = 0; qb < n_qb; ++qb) {
            const int64_t i0 = qb * p.bq, rows = std::min(p.bq, p.Sq - i0);
            if (p.skip(b, i0, rows, j0, cols)) continue;
            const T* Q = q.at(b, h, i0);
            const T* dO_i = dO.at(b, h, i0);
            gemm(false, true, rows, cols, p.D, p.scale, Q, q.s2, K, k.s2, 0.0f, s.data(), p.bk);
            if (p.softcap > 0) cap_tile(p, rows, cols, s.data(), p.bk, slope.data());
            mask_tile(p, b, h, i0, rows, j0, cols, s.data(), p.bk);
            for (int64_t r = 0; r < rows; ++r)
              exp_shifted(s.data() + r * p.bk, cols, lse_p[bh * p.Sq + i0 + r]);
            // dv += p^T do;  dp = do v^T;  ds = p * (dp - delta).
            gemm(true, false, cols, p.Dv, rows, 1.0f, s.data(), p.bk, dO_i, dO.s2, 1.0f, dv.data(),
                 p.Dv);
            gemm(false, true, rows, cols, p.Dv, 1.0f, dO_i, dO.s2, V, v.s2, 0.0f, dp.data(), p.bk);
            for (int64_t r = 0; r < rows; ++r) {
              const float dr = delta_p[bh * p.Sq + i0 + r];
              float* pr = s.data() + r * p.bk;
              float* dpr = dp.data() + r * p.bk;
              at::vec::map2([dr](Vec pv, Vec dpv) { return pv * (dpv - Vec(dr)); }, dpr, pr, dpr,
                            cols);
              if (want_dbias) {  // The bias is added after the cap: its gradient is ds.
                std::memcpy(g.dbias.data_ptr<float>() + (bh * p.Sq + i0 + r) * p.Sk + j0, dpr,
                            cols * sizeof(float));
              }
              if (p.softcap > 0) {
                at::vec::map2([](Vec d, Vec sl) { return d * sl; }, dpr, dpr,
                              slope.data() + r * p.bk, cols);
              }
            }
            // dk += scale ds^T q;  dq += scale ds k.
            gemm(true, false, cols, p.D, rows, p.scale, dp.data(), p.bk, Q, q.s2, 1.0f, dk.data(),
                 p.D);
            gemm(false, false, rows, p.D, cols, p.scale, dp.data(), p.bk, K, k.s2, 1.0f,
                 dq_base + (bh * p.Sq + i0) * p.D, p.D);
          }
        }
        float* dk_out = g.dk.data_ptr<float>() + ((b * p.Hkv + kvh) * p.Sk + j0) * p.D;
        float* dv_out = g.dv.data_ptr<float>() + ((b * p.Hkv + kvh) * p.Sk + j0) * p.Dv;
        std::memcpy(dk_out, dk.data(), cols * p.D * sizeof(float));
        std::memcpy(dv_out, dv.data(), cols * p.Dv * sizeof(float));
      }
    }
  });
  g.dq = chunks == 1 ? dq_parts[0] : dq_parts.sum(0);
  return g;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> forward_any(const FlashProblem& p) {
  return p.bf16 ? forward<c10::BFloat16>(p) : forward<float>(p);
}

FlashGrads backward_any(const FlashProblem& p, const at::Tensor& d_out, const at::Tensor& delta,
                        const at::Tensor& lse, bool want_dbias) {
  return p.bf16 ? backward<c10::BFloat16>(p, d_out, delta, lse, want_dbias)
                : backward<float>(p, d_out, delta, lse, want_dbias);
}

FlashPasses flash_passes() { return {forward_any, backward_any, C10_STRINGIZE(CPU_CAPABILITY)}; }

}  // namespace CPU_CAPABILITY
}  // namespace ulysses::detail
