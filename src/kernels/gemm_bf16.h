// A GEMM that multiplies in bf16 and accumulates in fp32, on AVX512-BF16 (vdpbf16ps): the fused
// kernel's tile GEMMs for bf16 inputs. libtorch_cpu's own routes do not pay here: MKL's
// cblas_gemm_bf16bf16f32 runs at 0.88-1.03x its sgemm on this AMD CPU (MKL's bf16 kernels are
// dispatched for Intel CPUs), and oneDNN's bf16 GEMM, which at::mm uses, is not exported.
// Built in its own file (src/gemm_bf16.cpp) with the AVX512-BF16 flags, so no other code is
// compiled for them; callers check has_bf16_gemm() first.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace ulysses::detail {

// True when this CPU runs AVX512-BF16 and the library holds the GEMM (x86-64 builds).
bool has_bf16_gemm();

// uint32 words of scratch gemm_bf16 needs for these sizes.
int64_t gemm_bf16_scratch(int64_t M, int64_t N, int64_t K);

// Row-major C[M, N] = alpha * op(A) op(B) + beta * C, op(X) = X^T when its flag is set, A and B
// fp32 or bf16 (fp32 operands are rounded to bf16, to nearest even), every product summed in
// fp32. beta == 0 never reads C.
template <typename TA, typename TB>
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const TA* A, int64_t lda, const TB* B, int64_t ldb, float beta, float* C,
               int64_t ldc, uint32_t* scratch);

}  // namespace ulysses::detail
