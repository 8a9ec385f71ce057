// The bf16 tile GEMM (see detail/gemm_bf16.h). vdpbf16ps multiplies pairs of bf16 values along
// K and adds both products to one fp32 lane, so B is packed as [K/2][N] 32-bit pairs (N padded
// to the 32 columns of a register pair) and A is read as pairs in place when it is bf16 with K
// contiguous, else packed the same way. An 8 x 32 block of C lives in 16 registers.
// This file holds no standard-library templates: compiled with the AVX512-BF16 flags, an
// out-of-line copy of one could be the one the linker keeps for the whole library.
#include "kernels/gemm_bf16.h"

#include <cstring>
#include <stdexcept>
#include <type_traits>

#if defined(__x86_64__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace ulysses::detail {
namespace {

using u32 = uint32_t;
constexpr int64_t kMR = 8, kNR = 32;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

__mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// Up to 16 values from p as bf16 bits in 16-bit lanes (fp32 rounded to nearest even); the
// lanes past n are 0.
__m256i load16(const float* p, int64_t n) {
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first(n), p)));
}
__m256i load16(const c10::BFloat16* p, int64_t n) { return _mm256_maskz_loadu_epi16(first(n), p); }

uint16_t bf16_bits(float x) {
  return static_cast<uint16_t>(
      _mm_cvtsi128_si32(reinterpret_cast<__m128i>(_mm_cvtneps_pbh(_mm_set_ss(x)))));
}
uint16_t bf16_bits(c10::BFloat16 x) { return x.x; }

// out[kk][x] = (src[2kk][x], src[2kk + 1][x]) for kk < ceil(rows / 2), x < width (zeros past
// cols): the pairs of a matrix whose other index is contiguous.
template <typename T>
void pack_row_pairs(const T* src, int64_t ld, int64_t rows, int64_t cols, int64_t width, u32* out) {
  for (int64_t kk = 0; 2 * kk < rows; ++kk) {
    const T* r0 = src + 2 * kk * ld;
    const bool second = 2 * kk + 1 < rows;
    for (int64_t x = 0; x < width; x += 16) {
      const int64_t n = cols - x;
      const __m512i lo = _mm512_cvtepu16_epi32(load16(r0 + x, n));
      const __m512i hi = second ? _mm512_cvtepu16_epi32(load16(r0 + ld + x, n)) : __m512i{};
      _mm512_storeu_si512(out + kk * width + x, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// out[m][kk] = (src[m][2kk], src[m][2kk + 1]): rows with K contiguous, as bf16 pairs.
template <typename T>
void pack_rows(const T* src, int64_t ld, int64_t M, int64_t K, u32* out) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t m = 0; m < M; ++m) {
    char* o = reinterpret_cast<char*>(out + m * K2);
    for (int64_t k = 0; k < 2 * K2; k += 16) {
      _mm256_mask_storeu_epi16(o + 2 * k, first(2 * K2 - k), load16(src + m * ld + k, K - k));
    }
  }
}

// out[kk][n] = (src[n][2kk], src[n][2kk + 1]), zeros for n >= N: B^T given with K contiguous.
template <typename T>
void pack_transposed(const T* src, int64_t ld, int64_t N, int64_t K, int64_t width, u32* out) {
  const int64_t K2 = (K + 1) / 2;
  std::memset(out, 0, sizeof(u32) * K2 * width);
  for (int64_t n = 0; n < N; ++n) {
    const T* row = src + n * ld;
    for (int64_t kk = 0; kk < K2; ++kk) {
      const u32 lo = bf16_bits(row[2 * kk]);
      const u32 hi = 2 * kk + 1 < K ? bf16_bits(row[2 * kk + 1]) : 0u;
      out[kk * width + n] = lo | (hi << 16);
    }
  }
}

u32 load_u32(const char* p) {
  u32 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// C[0:MR, 0:cols] = alpha * sum_kk A[r][kk] . B[kk][0:32] + beta * C. A's pair (r, kk) is at
// a + r * a_row + kk * a_pair (bytes).
template <int MR>
void block(int64_t K2, const char* a, int64_t a_row, int64_t a_pair, const u32* b, int64_t ldb,
           int64_t cols, float alpha, float beta, float* C, int64_t ldc) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + kk * ldb));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + kk * ldb + 16));
    const char* ak = a + kk * a_pair;
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(load_u32(ak + r * a_row)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int r = 0; r < MR; ++r) {
    for (int half = 0; half < 2; ++half) {
      const __mmask16 mask = first(cols - 16 * half);
      if (!mask) continue;
      float* c = C + r * ldc + 16 * half;
      __m512 v = _mm512_mul_ps(va, acc[r][half]);
      if (beta != 0.0f) v = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mask, c), v);
      _mm512_mask_storeu_ps(c, mask, v);
    }
  }
}

using Block = void (*)(int64_t, const char*, int64_t, int64_t, const u32*, int64_t, int64_t, float,
                       float, float*, int64_t);
constexpr Block kBlocks[kMR + 1] = {nullptr,  block<1>, block<2>, block<3>, block<4>,
                                    block<5>, block<6>, block<7>, block<8>};

}  // namespace

bool has_bf16_gemm() {
  static const bool has = __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
}

int64_t gemm_bf16_scratch(int64_t M, int64_t N, int64_t K) {
  return (K + 1) / 2 * (round_up(N, kNR) + round_up(M, 16));
}

template <typename TA, typename TB>
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const TA* A, int64_t lda, const TB* B, int64_t ldb, float beta, float* C,
               int64_t ldc, uint32_t* scratch) {
  if (M <= 0 || N <= 0) return;
  const int64_t K2 = (K + 1) / 2, width = round_up(N, kNR);
  u32* bp = scratch;
  u32* ap = scratch + K2 * width;
  if (trans_b) {
    pack_transposed(B, ldb, N, K, width, bp);  // op(B)[k][n] = B[n][k].
  } else {
    pack_row_pairs(B, ldb, K, N, width, bp);
  }
  const char* a;
  int64_t a_row, a_pair;  // Bytes from one row, and from one pair, to the next.
  if (trans_a) {          // op(A)[m][k] = A[k][m]: pairs of A's rows.
    const int64_t mp = round_up(M, 16);
    pack_row_pairs(A, lda, K, M, mp, ap);
    a = reinterpret_cast<const char*>(ap), a_row = sizeof(u32), a_pair = sizeof(u32) * mp;
  } else if (std::is_same_v<TA, c10::BFloat16> && K % 2 == 0) {  // Pairs in place.
    a = reinterpret_cast<const char*>(A), a_row = 2 * lda, a_pair = sizeof(u32);
  } else {
    pack_rows(A, lda, M, K, ap);
    a = reinterpret_cast<const char*>(ap), a_row = sizeof(u32) * K2, a_pair = sizeof(u32);
  }
  for (int64_t n0 = 0; n0 < N; n0 += kNR) {
    const int64_t cols = N - n0 < kNR ? N - n0 : kNR;
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t rows = M - m0 < kMR ? M - m0 : kMR;
      kBlocks[rows](K2, a + m0 * a_row, a_row, a_pair, bp + n0, width, cols, alpha, beta,
                    C + m0 * ldc + n0, ldc);
    }
  }
}

}  // namespace ulysses::detail

#else  // No AVX512-BF16 build (another architecture).

namespace ulysses::detail {

bool has_bf16_gemm() { return false; }
int64_t gemm_bf16_scratch(int64_t, int64_t, int64_t) { return 0; }

template <typename TA, typename TB>
void gemm_bf16(bool, bool, int64_t, int64_t, int64_t, float, const TA*, int64_t, const TB*, int64_t,
               float, float*, int64_t, uint32_t*) {
  throw std::logic_error("gemm_bf16: this build has no AVX512-BF16 GEMM (check has_bf16_gemm)");
}

}  // namespace ulysses::detail

#endif

namespace ulysses::detail {
#define ULYSSES_GEMM_BF16(TA, TB)                                                          \
  template void gemm_bf16<TA, TB>(bool, bool, int64_t, int64_t, int64_t, float, const TA*, \
                                  int64_t, const TB*, int64_t, float, float*, int64_t, uint32_t*);
ULYSSES_GEMM_BF16(float, float)
ULYSSES_GEMM_BF16(float, c10::BFloat16)
ULYSSES_GEMM_BF16(c10::BFloat16, float)
ULYSSES_GEMM_BF16(c10::BFloat16, c10::BFloat16)
#undef ULYSSES_GEMM_BF16
}  // namespace ulysses::detail
