// The fused kernel's passes, compiled once per CPU instruction set (src/kernels/flash_kernel.cpp,
// built as DEFAULT, AVX2 and AVX512 objects the way ATen builds its own kernels: each in its
// CPU_CAPABILITY namespace, at::vec in real vector registers). flash_attention.cpp checks the
// call, builds the Problem and runs the passes of the instruction set ATen chose for this CPU
// (at::get_cpu_capability(), which ATEN_CPU_CAPABILITY overrides).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace ulysses::detail {

// Everything a forward or backward pass reads; tensors hold the memory the pointers refer to.
struct FlashProblem {
  at::Tensor q, k, v;           // fp32 (or bf16 with `bf16`), last dim contiguous, BHSD.
  at::Tensor bias;              // Additive float mask expanded to [B, Hq, Sq, Sk], or {}.
  at::Tensor allowed;           // Bool mask expanded to [B, Hq, Sq, Sk], or {}.
  at::Tensor q_index, k_index;  // [Sq], [Sk] contiguous int64 global rows (causal rule).
  at::Tensor q_doc, k_doc;      // [B, Sq], [B, Sk] document ids (stride 0 over B allowed), or {}.
  std::vector<int64_t> kv_map;  // Local kv head of each query head.
  bool causal = false;
  int64_t window = 0;    // > 0: keys with index <= query index - window are not seen.
  float softcap = 0.0f;  // > 0: scores s become softcap * tanh(s / softcap) before the masks.
  float scale = 1.0f;
  // q, k, v and the backward's d_out are bf16 and every tile GEMM multiplies in bf16 (fp32
  // accumulation, softmax statistics and gradients in fp32; detail/gemm_bf16.h).
  bool bf16 = false;
  int64_t bq = 0, bk = 0;  // Tile sizes, as make_problem picks them.
  int64_t B = 0, Hq = 0, Hkv = 0, Sq = 0, Sk = 0, D = 0, Dv = 0;

  const int64_t* qi() const { return q_index.data_ptr<int64_t>(); }
  const int64_t* ki() const { return k_index.data_ptr<int64_t>(); }

  // A tile with no allowed (query, key) pair: every key after every query, or in disjoint
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
};

struct FlashGrads {
  at::Tensor dq, dk, dv, dbias;  // fp32; dbias [B, Hq, Sq, Sk] only when the bias needs it.
};

// One instruction set's passes. forward: out [B, Hq, Sq, Dv] and lse [B, Hq, Sq] (fp32,
// contiguous). backward: from d_out [B, Hq, Sq, Dv] (q's kernel dtype, last dim contiguous, any
// other strides), the forward's lse and delta = rowsum(d_out * out) [B, Hq, Sq] (fp32,
// contiguous; detail::attention_delta), the only use of the forward's out.
struct FlashPasses {
  std::pair<at::Tensor, at::Tensor> (*forward)(const FlashProblem&);
  FlashGrads (*backward)(const FlashProblem&, const at::Tensor& d_out, const at::Tensor& delta,
                         const at::Tensor& lse, bool want_dbias);
  const char* isa;
};

namespace DEFAULT {
FlashPasses flash_passes();
}
namespace AVX2 {
FlashPasses flash_passes();
}
namespace AVX512 {
FlashPasses flash_passes();
}

}  // namespace ulysses::detail
