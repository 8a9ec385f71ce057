// The CPU flash-attention kernel. See flash_attention.h for the equations.
#include "ulysses/flash_attention.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "detail/kernel_ops.h"
#include "ulysses/mask_decision.h"

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc);

namespace ulysses {
namespace {

using Vec = at::vec::Vectorized<float>;
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

// exp(x) to ~2 ulp for x in [-87, 88], exactly 0 below: a branch-free form the compiler
// vectorises (std::exp is a scalar call, and p = exp(s - m) is the kernel's hot loop).
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// row[c] = exp(row[c] - shift); returns the sum.
float exp_shifted(float* row, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < n; ++c) {
    row[c] = fast_exp(row[c] - shift);
    sum += row[c];
  }
  return sum;
}

float row_max(const float* row, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, n);
}

void scale_row(float* row, int64_t n, float factor) {
  at::vec::map([factor](Vec x) { return x * Vec(factor); }, row, row, n);
}

// A 4-D float tensor whose last dim is contiguous, as strides for pointer arithmetic.
struct Strided {
  const float* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  const float* at(int64_t i0, int64_t i1, int64_t i2) const {
    return data + i0 * s0 + i1 * s1 + i2 * s2;
  }
};

Strided strided(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.scalar_type() == at::kFloat && t.stride(3) == 1);
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}

// Everything a forward or backward pass reads; tensors hold the memory the pointers refer to.
struct Problem {
  at::Tensor q, k, v;           // Float, last dim contiguous, BHSD.
  at::Tensor bias;              // Additive float mask expanded to [B, Hq, Sq, Sk], or {}.
  at::Tensor allowed;           // Bool mask expanded to [B, Hq, Sq, Sk], or {}.
  at::Tensor q_index, k_index;  // [Sq], [Sk] contiguous int64 global rows (causal rule).
  at::Tensor q_doc, k_doc;      // [B, Sq], [B, Sk] document ids (stride 0 over B allowed), or {}.
  std::vector<int64_t> kv_map;  // Local kv head of each query head.
  bool causal = false;
  int64_t window = 0;    // > 0: keys with index <= query index - window are not seen.
  float softcap = 0.0f;  // > 0: scores s become softcap * tanh(s / softcap) before the masks.
  float scale = 1.0f;
  int64_t bq = 128, bk = 256;
  int64_t B = 0, Hq = 0, Hkv = 0, Sq = 0, Sk = 0, D = 0, Dv = 0;

  const int64_t* qi() const { return q_index.data_ptr<int64_t>(); }
  const int64_t* ki() const { return k_index.data_ptr<int64_t>(); }

  // Skips a tile with no allowed (query, key) pair: every key after every query, or in disjoint
  // documents (indices increase and document ids never decrease along the rows).
  bool skip(int64_t b, int64_t i0, int64_t rows, int64_t j0, int64_t cols) const {
    if (causal && ki()[j0] > qi()[i0 + rows - 1]) return true;
    if (window > 0 && ki()[j0 + cols - 1] <= qi()[i0] - window) return true;  // All too old.
    if (!q_doc.defined()) return false;
    const int64_t* dq = q_doc.data_ptr<int64_t>() + b * q_doc.stride(0);
    const int64_t* dk = k_doc.data_ptr<int64_t>() + b * k_doc.stride(0);
    const int64_t sq = q_doc.stride(1), sk = k_doc.stride(1);
    return dk[(j0 + cols - 1) * sk] < dq[i0 * sq] || dk[j0 * sk] > dq[(i0 + rows - 1) * sq];
  }

  // Caps the scores of tile s (rows x cols, leading dim lds): s = softcap * tanh(s / softcap).
  // With `slope`, also stores d(capped)/ds = 1 - (capped / softcap)^2 there (the backward's).
  void cap_tile(int64_t rows, int64_t cols, float* s, int64_t lds, float* slope = nullptr) const {
    const float c = softcap, inv = 1.0f / softcap;
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
  void mask_tile(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols, float* s,
                 int64_t lds) const {
    const int64_t* kidx = ki() + j0;
    const bool diagonal = causal && kidx[cols - 1] > qi()[i0];
    const bool window_edge = window > 0 && kidx[0] <= qi()[i0 + rows - 1] - window;
    const int64_t* dq = q_doc.defined() ? q_doc.data_ptr<int64_t>() + b * q_doc.stride(0) : nullptr;
    const int64_t* dk = q_doc.defined() ? k_doc.data_ptr<int64_t>() + b * k_doc.stride(0) : nullptr;
    const int64_t sq = dq ? q_doc.stride(1) : 0, sk = dq ? k_doc.stride(1) : 0;
    const bool mixed_docs =
        dq && !(dq[i0 * sq] == dq[(i0 + rows - 1) * sq] &&
                dk[j0 * sk] == dk[(j0 + cols - 1) * sk] && dq[i0 * sq] == dk[j0 * sk]);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      float* row = s + r * lds;
      if (bias.defined()) {
        const float* bp = bias.data_ptr<float>() + b * bias.stride(0) + h * bias.stride(1) +
                          i * bias.stride(2) + j0 * bias.stride(3);
        const int64_t st = bias.stride(3);
        if (st == 1) {
          for (int64_t c = 0; c < cols; ++c) row[c] += bp[c];
        } else {
          for (int64_t c = 0; c < cols; ++c) row[c] += bp[c * st];
        }
      }
      if (allowed.defined()) {
        const bool* ap = allowed.data_ptr<bool>() + b * allowed.stride(0) + h * allowed.stride(1) +
                         i * allowed.stride(2) + j0 * allowed.stride(3);
        const int64_t st = allowed.stride(3);
        for (int64_t c = 0; c < cols; ++c)
          if (!ap[c * st]) row[c] = kNegInf;
      }
      if (diagonal) {  // Keys after query i: from the first index above q_index[i] on.
        const int64_t first = std::upper_bound(kidx, kidx + cols, qi()[i]) - kidx;
        for (int64_t c = first; c < cols; ++c) row[c] = kNegInf;
      }
      if (window_edge) {  // Keys out of query i's window: those up to q_index[i] - window.
        const int64_t past = std::upper_bound(kidx, kidx + cols, qi()[i] - window) - kidx;
        for (int64_t c = 0; c < past; ++c) row[c] = kNegInf;
      }
      if (mixed_docs) {
        const int64_t di = dq[i * sq];
        for (int64_t c = 0; c < cols; ++c)
          if (dk[(j0 + c) * sk] != di) row[c] = kNegInf;
      }
    }
  }
};

// Forward: out [B, Hq, Sq, Dv] and lse [B, Hq, Sq] (float, contiguous).
std::pair<at::Tensor, at::Tensor> forward(const Problem& p) {
  at::Tensor out = at::empty({p.B, p.Hq, p.Sq, p.Dv}, p.q.options());
  at::Tensor lse = at::empty({p.B, p.Hq, p.Sq}, p.q.options());
  const Strided q = strided(p.q), k = strided(p.k), v = strided(p.v);
  const int64_t n_qb = (p.Sq + p.bq - 1) / p.bq;
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  at::parallel_for(0, p.B * p.Hq * n_qb, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(p.bq * p.bk), acc(p.bq * p.Dv), m(p.bq), l(p.bq);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % n_qb, h = (task / n_qb) % p.Hq, b = task / (n_qb * p.Hq);
      const int64_t i0 = qb * p.bq, rows = std::min(p.bq, p.Sq - i0);
      const int64_t g = p.kv_map[h];
      const float* Q = q.at(b, h, i0);
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
        if (p.softcap > 0) p.cap_tile(rows, cols, s.data(), p.bk);
        p.mask_tile(b, h, i0, rows, j0, cols, s.data(), p.bk);
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

struct Grads {
  at::Tensor dq, dk, dv, dbias;  // Float; dbias [B, Hq, Sq, Sk] only when the bias needs it.
};

// Backward from d_out [B, Hq, Sq, Dv] (float, last dim contiguous, any other strides: a
// head-sharded gradient is read where the exchange left it) and the forward's out and lse.
// Tasks own (batch, kv head, key blocks kb = c mod C): dk and dv of their key blocks and, when
// C == 1, dq of the kv head's query heads, so no two tasks write the same memory.
Grads backward(const Problem& p, const at::Tensor& d_out, const at::Tensor& out,
               const at::Tensor& lse, bool want_dbias) {
  const Strided q = strided(p.q), k = strided(p.k), v = strided(p.v);
  const int64_t n_qb = (p.Sq + p.bq - 1) / p.bq, n_kb = (p.Sk + p.bk - 1) / p.bk;
  const int64_t threads = at::get_num_threads();
  const int64_t chunks =
      std::max<int64_t>(1, std::min(n_kb, (threads + p.B * p.Hkv - 1) / (p.B * p.Hkv)));
  at::Tensor delta = (d_out * out).sum(-1);  // [B, Hq, Sq]
  at::Tensor dq_parts = at::zeros({chunks, p.B, p.Hq, p.Sq, p.D}, p.q.options());
  Grads g;
  g.dk = at::empty({p.B, p.Hkv, p.Sk, p.D}, p.q.options());
  g.dv = at::empty({p.B, p.Hkv, p.Sk, p.Dv}, p.q.options());
  if (want_dbias) g.dbias = at::zeros({p.B, p.Hq, p.Sq, p.Sk}, p.q.options());
  const Strided dO = strided(d_out);
  const float* lse_p = lse.data_ptr<float>();
  const float* delta_p = delta.data_ptr<float>();
  at::parallel_for(0, p.B * p.Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(p.bq * p.bk), dp(p.bq * p.bk), dk(p.bk * p.D), dv(p.bk * p.Dv);
    std::vector<float> slope(p.softcap > 0 ? p.bq * p.bk : 0);  // d(capped score)/d(score).
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task % chunks, kvh = (task / chunks) % p.Hkv, b = task / (chunks * p.Hkv);
      float* dq_base = dq_parts.data_ptr<float>() + c * p.B * p.Hq * p.Sq * p.D;
      for (int64_t kb = c; kb < n_kb; kb += chunks) {
        const int64_t j0 = kb * p.bk, cols = std::min(p.bk, p.Sk - j0);
        const float* K = k.at(b, kvh, j0);
        const float* V = v.at(b, kvh, j0);
        std::fill(dk.begin(), dk.end(), 0.0f);
        std::fill(dv.begin(), dv.end(), 0.0f);
        for (int64_t h = 0; h < p.Hq; ++h) {
          if (p.kv_map[h] != kvh) continue;
          const int64_t bh = b * p.Hq + h;
          for (int64_t qb = 0; qb < n_qb; ++qb) {
            const int64_t i0 = qb * p.bq, rows = std::min(p.bq, p.Sq - i0);
            if (p.skip(b, i0, rows, j0, cols)) continue;
            const float* Q = q.at(b, h, i0);
            const float* dO_i = dO.at(b, h, i0);
            gemm(false, true, rows, cols, p.D, p.scale, Q, q.s2, K, k.s2, 0.0f, s.data(), p.bk);
            if (p.softcap > 0) p.cap_tile(rows, cols, s.data(), p.bk, slope.data());
            p.mask_tile(b, h, i0, rows, j0, cols, s.data(), p.bk);
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

// Float rows with a contiguous last dim and a BLAS-valid row stride, as the kernel reads
// them (a no-op for fp32 BHSD tensors and for BSHD tensors viewed as BHSD).
at::Tensor as_kernel_input(const at::Tensor& t) {
  at::Tensor f = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
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
  TORCH_CHECK_VALUE(options.block_q >= 1 && options.block_k >= 0,
                    "flash_attention: block sizes must be >= 1; got ", options.block_q, ", ",
                    options.block_k);
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
  p.q = as_kernel_input(a.q).detach();
  p.k = as_kernel_input(a.k).detach();
  p.v = as_kernel_input(a.v).detach();
  p.B = a.q.size(0), p.Hq = a.q.size(1), p.Sq = a.q.size(2), p.D = a.q.size(3);
  p.Hkv = a.k.size(1), p.Sk = a.k.size(2), p.Dv = a.v.size(3);
  p.kv_map = a.kv_map;
  p.causal = a.causal;
  p.window = a.window;
  p.softcap = static_cast<float>(a.softcap);
  p.scale = static_cast<float>(a.scale > 0 ? a.scale : 1.0 / std::sqrt(static_cast<double>(p.D)));
  p.bq = options.block_q;
  p.bk = options.block_k;
  if (p.bk == 0) {
    const int64_t fit = (int64_t{1} << 21) / (p.bq * std::max(p.D, p.Dv));
    p.bk = std::max<int64_t>(16, std::min<int64_t>(256, fit / 16 * 16));
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
  auto [out, lse] = forward(p);
  if (out.scalar_type() != a.q.scalar_type()) out = out.to(a.q.scalar_type());
  return {out, lse};
}

std::vector<at::Tensor> flash_attention_backward(const at::Tensor& grad_out,
                                                 const LocalAttentionArgs& a, const at::Tensor& out,
                                                 const at::Tensor& lse, bool mask_grad,
                                                 const FlashOptions& options) {
  TORCH_CHECK_VALUE(!mask_grad || (a.mask && a.mask->is_floating_point()),
                    "flash_attention_backward: a mask gradient needs a floating-point mask");
  const Problem p = make_problem(a, options);
  at::NoGradGuard no_grad;
  Grads g = backward(p, as_kernel_input(grad_out), out.to(at::kFloat), lse, mask_grad);
  std::vector<at::Tensor> result{g.dq.to(a.q.scalar_type()), g.dk.to(a.k.scalar_type()),
                                 g.dv.to(a.v.scalar_type()), at::Tensor()};
  if (mask_grad) result[3] = g.dbias.sum_to_size(a.mask->sizes()).to(a.mask->scalar_type());
  return result;
}

at::Tensor flash_attention(const LocalAttentionArgs& a, const FlashOptions& options) {
  if (a.q.scalar_type() == at::kDouble) return math_attention(a);
  return std::get<0>(detail::call_flash_attention(a, options));
}

}  // namespace ulysses
