// Fused memory-efficient local attention on CPU (FlashAttention-2 style), forward and backward.
//
// Blocks of Bq queries stream over blocks of Bk keys with an online softmax:
//   s = scale * q_i k_j^T + bias;  m' = max(m, rowmax s);  p = exp(s - m')
//   l' = l * exp(m - m') + rowsum p;  o' = o * exp(m - m') + p v_j
// and finally o = o' / l, lse = m + log l. The S x S scores never exist: memory is
// O(B * H * S * D). Backward recomputes p = exp(s - lse) block by block from the saved o and
// lse: dv_j += p^T do_i, dp = do_i v_j^T, ds = p * (dp - rowsum(do_i * o_i)),
// dk_j += scale ds^T q_i, dq_i += scale ds k_j (and dbias = ds for a learnable float mask).
// Key blocks wholly above the causal diagonal, or in other packed documents, are skipped.
// GQA and any kv map read K/V in place (no repeat). fp32, bf16 and fp16 compute in fp32.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

#include "ulysses/attention.h"

namespace ulysses {

// Tile sizes of flash_attention.
struct FlashOptions {
  // Query rows per tile, >= 1; 0 picks 256 from S = 2048 on, 128 from 1024, else 64.
  int64_t block_q = 0;
  // Keys per tile, >= 1; 0 picks block_q (at least 64), or less where the tile GEMM would
  // exceed block_q * block_k * max(D, Dv) = 2^22 multiply-adds (multiples of 16). The passes are
  // GEMM-bound (MKL's sgemm_, single-threaded inside our parallel loop) and large tiles amortise
  // its per-call packing; short sequences take small ones so that causal attention skips most of
  // the upper triangle (docs/benchmarks.md, "Tile sizes", has the measurements).
  int64_t block_k = 0;
};

// The instruction set the kernel runs in: "AVX512", "AVX2" or "DEFAULT", as ATen chose for
// this CPU (at::get_cpu_capability(); the environment variable ATEN_CPU_CAPABILITY lowers it).
std::string flash_attention_isa();

// True when bf16 inputs multiply in bf16 here: the AVX512 passes run and the CPU has
// AVX512-BF16 (fp32 accumulation and softmax); elsewhere bf16 and fp16 compute in fp32.
bool flash_attention_bf16_gemm();

// Same contract as math_attention (see attention.h), without materialising [S, S] scores.
// Differentiable in q, k, v and a floating-point mask. fp64 inputs fall back to
// math_attention.
at::Tensor flash_attention(const LocalAttentionArgs& args, const FlashOptions& options = {});

// The two passes of flash_attention, without autograd (for the dispatcher op, whose autograd is
// registered around them). Forward returns o [B, Hq, Sq, Dv] in q's dtype and the row
// log-sum-exp lse [B, Hq, Sq] (fp32). fp32, bf16 and fp16 only.
std::tuple<at::Tensor, at::Tensor> flash_attention_forward(const LocalAttentionArgs& args,
                                                           const FlashOptions& options = {});
// Gradients {dq, dk, dv, dmask} of flash_attention for `grad_out` [B, Hq, Sq, Dv], given the
// forward's `out` and `lse`. dmask (summed to the mask's shape) is defined only if `mask_grad`.
std::vector<at::Tensor> flash_attention_backward(const at::Tensor& grad_out,
                                                 const LocalAttentionArgs& args,
                                                 const at::Tensor& out, const at::Tensor& lse,
                                                 bool mask_grad, const FlashOptions& options = {});

// Exact merge of two partial attentions of the same queries over disjoint key sets:
// (out_a, lse_a) and (out_b, lse_b) with out [.., S, Dv] and lse [.., S] (fp32; a row with no
// allowed key has lse = +inf, as flash_attention_forward returns it) give the attention over
// both key sets. Differentiable in all four inputs.
std::tuple<at::Tensor, at::Tensor> merge_attention(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                   const at::Tensor& out_b,
                                                   const at::Tensor& lse_b);

}  // namespace ulysses
