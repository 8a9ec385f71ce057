// Local attention: what each rank runs on its own heads over the full sequence.
//
// For local query head h (kv head g = kv_map[h]), query i and key j:
//   s[b,h,i,j] = scale * <q[b,h,i,:], k[b,g,j,:]> + bias[b,h,i,j]   (additive float mask)
//   allowed(i,j) = mask[b,h,i,j] (bool mask) && (!causal || j <= i) && doc(b,i) == doc(b,j)
//                  && (window == 0 || i - j < window)
//   o[b,h,i,:]  = sum_j softmax_j(s | allowed) * v[b,g,j,:]
// (with sinks, the softmax's denominator also holds exp(sinks[h]): o = sum_j e^s_ij v_j /
// (sum_j e^s_ij + e^sinks[h]))
// where doc(b,i) counts the position ids equal to 0 up to i (packed documents restart their
// positions at 0). A query row with no allowed key gets o = 0 (and zero gradients).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <functional>
#include <string>
#include <vector>

#include "ulysses/attention_rules.h"

namespace ulysses {

// Where the rows of q and k lie in one global sequence, when k is not q's own block (ring
// attention passes key blocks between ranks): the causal rule is k_index[j] <= q_index[i] and
// the document rule q_docs[b, i] == k_docs[b, j]. Indices increase and document ids never
// decrease along the rows, so the fused kernel still skips whole tiles.
struct GlobalRows {
  at::Tensor q_index;  // [Sq] int64 global token index of each query row.
  at::Tensor k_index;  // [Sk] int64 likewise for the keys.
  at::Tensor q_docs;   // [B or 1, Sq] int64 document ids, or undefined: no document rule.
  at::Tensor k_docs;   // [B or 1, Sk] int64, defined exactly when q_docs is.
};

// Inputs of a local attention, in BHSD: q [B, Hq_r, S, D], k [B, Hkv_r, S, D],
// v [B, Hkv_r, S, Dv] (any strides). Output: [B, Hq_r, S, Dv].
// An aggregate (callers brace-initialise it: {q, k, v, kv_map, mask}), so the rules stay its own
// fields, read and written as one AttentionRules value through rules() and set_rules().
struct LocalAttentionArgs {
  at::Tensor q, k, v;
  std::vector<int64_t> kv_map;          // Local kv head of each local query head (size Hq_r).
  c10::optional<at::Tensor> mask;       // Bool or additive float, broadcastable to [B,Hq_r,S,S].
  c10::optional<at::Tensor> positions;  // [B, S] or [S] int64 global position ids (packing).
  bool causal = false;                  // The rules (attention_rules.h): causal, scale,
  double scale = 0.0;                   // window and softcap.
  // Global rows for the causal and document rules (then `positions` must be unset); k may
  // then have another length than q.
  c10::optional<GlobalRows> rows;
  int64_t window = 0;
  double softcap = 0.0;
  // Attention sinks (gpt-oss's): one logit per local query head [Hq_r], added to each row's
  // softmax denominator (a key no query's output reads); learnable. Unset: none.
  c10::optional<at::Tensor> sinks;

  AttentionRules rules() const { return {causal, scale, window, softcap}; }
  void set_rules(const AttentionRules& r) {
    causal = r.causal, scale = r.scale, window = r.window, softcap = r.softcap;
  }
};

// The attention-sinks rule: none, or a floating-point [q_heads] tensor; throws
// c10::ValueError otherwise.
void check_sinks(const c10::optional<at::Tensor>& sinks, int64_t q_heads);

// A local attention implementation.
using LocalAttention = std::function<at::Tensor(const LocalAttentionArgs&)>;

// The exact local kernels, and the rule that picks one per case.
enum class LocalKernel {
  kAuto,   // The rule below.
  kFused,  // flash_attention: CPU; fp32, bf16, fp16 (computed in fp32); every mask and rule.
  kSdpa,   // at::scaled_dot_product_attention: any device; rules folded into a mask.
  kMath,   // math_attention: any device and dtype (fp64 exact); materialises the scores.
  kFlex,   // torch's FlexAttention (Python's ulysses.flex): every rule as a block mask and a
           // score function, memory linear in S. Python runs it; C++ runs kernel_run_by_cpp.
};
// "auto", "fused", "sdpa", "math" or "flex"; throws c10::ValueError naming the choices
// otherwise.
LocalKernel parse_local_kernel(const std::string& name);
std::string to_string(LocalKernel kernel);
// Every kernel, kAuto first: the names Python accepts.
std::vector<LocalKernel> local_kernels();

// What the kernel rule reads of a call: facts every rank agrees on before any data moves
// (position ids count as documents until gathered ones are known to split none).
struct KernelCase {
  c10::DeviceType device = c10::DeviceType::CPU;
  at::ScalarType dtype = at::kFloat;
  bool mask = false;       // A mask is given.
  bool documents = false;  // Position ids (or global rows) that may split rows into documents.
  int64_t window = 0;
  double softcap = 0.0;
  bool sinks = false;
  // The facts of a local attention's arguments.
  static KernelCase of(const LocalAttentionArgs& args);
  // No rule but (optionally) causal: what SDPA runs without a mask (flash-eligible).
  bool plain() const { return !mask && !documents && window == 0 && softcap == 0 && !sinks; }
};

// Note [Local attention by case]: the one rule that picks the kernel of every call, for C++
// and for Python (which runs what it names). kAuto, on CPU: fp64 the math kernel (exact in
// fp64); bf16 with no rule but causal on a CPU without AVX512-BF16 torch's SDPA, whose bf16
// GEMMs beat the fused kernel's fp32 compute there; every other case (fp32, fp16, bf16 where
// the CPU multiplies bf16, every rule) the fused kernel, which is the faster there and skips the
// tiles its rules exclude. On CUDA: SDPA for a plain case (flash-eligible), FlexAttention for
// every other (masks, documents, windows, softcap, sinks: memory in S, never S^2). Other
// devices: SDPA, the math kernel for a softcap or sinks (SDPA has neither). A requested kernel
// that cannot run the case raises c10::ValueError saying which kernels can.
LocalKernel choose_local_kernel(const KernelCase& c, LocalKernel requested);
LocalKernel choose_local_kernel(const LocalAttentionArgs& args, LocalKernel requested);
// The kernel C++ runs for the rule's `chosen`: flex is Python's, so C++ runs its case on the
// fused kernel on CPU (math for fp64), and elsewhere on the math kernel for a softcap or sinks
// and on SDPA with the rules as a dense mask otherwise, both bounded (Note [No silent S x S]).
LocalKernel kernel_run_by_cpp(LocalKernel chosen, const KernelCase& c);

// Note [No silent S x S]: where C++ runs a call off the CPU, the math kernel holds fp32 scores
// [B, Hq_r, S, S] (and their probabilities for the backward), and SDPA for a case with rules a
// dense mask [B, 1, S, S]. Above kSquareMaxBytes (counting 4 bytes an entry) an attention call
// is refused in its agreement, alike on every rank (from the agreed S, batch and the largest
// rank's query heads), before any data moves, naming the kernel to use instead; a local
// attention call alone is refused likewise.
enum class SquareBuffer : int64_t {
  kNone = 0,      // Memory in S.
  kScores = 1,    // The math kernel's scores, per query head.
  kRuleMask = 2,  // SDPA's mask of the causal, window and document rules, shared by the heads.
};
constexpr int64_t kSquareMaxBytes = int64_t{1} << 30;
// The S x S buffer C++ makes off the CPU when it runs `requested` for case `c`.
SquareBuffer square_buffer_off_cpu(const KernelCase& c, LocalKernel requested);
// Its bytes for `batch` rows, `heads` query heads (the largest rank's) and `seq_len` tokens.
int64_t square_buffer_bytes(SquareBuffer buffer, int64_t batch, int64_t heads, int64_t seq_len);
// Local attention on choose_local_kernel(args, kernel). Differentiable.
at::Tensor local_attention(const LocalAttentionArgs& args, LocalKernel kernel = LocalKernel::kAuto);
// SDPA with the kv map, causal and document rules as one mask.
at::Tensor sdpa_attention(const LocalAttentionArgs& args);

// Reference attention on libtorch ops: materialises [B, Hq_r, S, S] scores, computes in fp32
// (or fp64 for fp64 inputs) and is differentiated by autograd. The test reference.
at::Tensor math_attention(const LocalAttentionArgs& args);

// Document index of every position: doc[b, i] = #{ j <= i : positions[b, j] == 0 } - 1.
// positions: [B, S] or [S]; returns the same shape.
at::Tensor document_ids(const at::Tensor& positions);

// Whether `positions` (a whole sequence's, [B, S] or [S]) put two tokens of one row in
// different documents: a position 0 after a row's first token. Position ids 0..S-1 (what
// transformers passes for one sequence per row) split nothing, and the attention then runs
// without them: no document rule, no mask built from it. Reads the tensor on the host.
bool splits_documents(const at::Tensor& positions);

// The document mask of packed sequences as a bool tensor [B or 1, 1, S, S]: true where query i
// and key j lie in one document (doc(b,i) == doc(b,j)). For implementations that take a mask;
// the fused kernel evaluates the same rule per tile instead.
at::Tensor document_mask(const at::Tensor& positions);

// The causal, window and document rules of `args` (causal, window, positions, rows) for
// q [.., Sq, D] and k [.., Sk, D] as one bool mask [B or 1, 1, Sq, Sk], or none when no rule
// applies.
c10::optional<at::Tensor> structure_mask(const LocalAttentionArgs& args);

}  // namespace ulysses
