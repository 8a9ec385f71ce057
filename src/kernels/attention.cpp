#include "ulysses/attention.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "ulysses/flash_attention.h"
#include "ulysses/mask_decision.h"

namespace ulysses {

at::Tensor document_ids(const at::Tensor& positions) {
  TORCH_CHECK_TYPE(!positions.is_floating_point(), "document_ids: positions must be integer; got ",
                   positions.scalar_type());
  return positions.eq(0).to(at::kLong).cumsum(-1) - 1;
}

bool splits_documents(const at::Tensor& positions) {
  const int64_t S = positions.dim() == 0 ? 0 : positions.size(-1);
  return S > 1 && positions.narrow(-1, 1, S - 1).eq(0).any().item<bool>();
}

at::Tensor document_mask(const at::Tensor& positions) {
  at::Tensor doc = document_ids(positions);
  if (doc.dim() == 1) doc = doc.unsqueeze(0);
  return doc.unsqueeze(-1).eq(doc.unsqueeze(-2)).unsqueeze(1);
}

c10::optional<at::Tensor> structure_mask(const LocalAttentionArgs& a) {
  TORCH_CHECK_VALUE(!(a.rows && a.positions),
                    "attention: give either position ids or global rows, not both");
  check_window(a.window, a.causal);
  const int64_t Sq = a.q.size(-2), Sk = a.k.size(-2);
  const auto opts = a.q.options().dtype(at::kBool);
  c10::optional<at::Tensor> allowed;
  auto restrict = [&](const at::Tensor& m) { allowed = allowed ? allowed->logical_and(m) : m; };
  if (a.rows) {
    const GlobalRows& r = *a.rows;
    TORCH_CHECK_VALUE(r.q_index.numel() == Sq && r.k_index.numel() == Sk,
                      "attention: global rows must index the ", Sq, " queries and ", Sk,
                      " keys; got ", r.q_index.sizes(), " and ", r.k_index.sizes());
    TORCH_CHECK_VALUE(r.q_docs.defined() == r.k_docs.defined(),
                      "attention: give document ids for both queries and keys, or neither");
    if (a.causal) {
      restrict(r.k_index.view({1, Sk})
                   .le(r.q_index.view({Sq, 1}))
                   .view({1, 1, Sq, Sk})
                   .to(opts.device()));
    }
    if (a.window > 0) {
      restrict(r.k_index.view({1, Sk})
                   .gt(r.q_index.view({Sq, 1}) - a.window)
                   .view({1, 1, Sq, Sk})
                   .to(opts.device()));
    }
    if (r.q_docs.defined()) {
      restrict(r.q_docs.view({-1, 1, Sq, 1}).eq(r.k_docs.view({-1, 1, 1, Sk})).to(opts.device()));
    }
    return allowed;
  }
  if (a.causal) restrict(at::ones({Sq, Sk}, opts).tril().view({1, 1, Sq, Sk}));
  if (a.window > 0) restrict(at::ones({Sq, Sk}, opts).triu(1 - a.window).view({1, 1, Sq, Sk}));
  if (a.positions) restrict(document_mask(*a.positions).to(opts.device()));
  return allowed;
}

at::Tensor math_attention(const LocalAttentionArgs& a) {
  TORCH_CHECK_VALUE(a.q.dim() == 4 && a.k.dim() == 4 && a.v.dim() == 4,
                    "math_attention: q, k, v must be 4-D BHSD; got ", a.q.sizes(), ", ",
                    a.k.sizes(), ", ", a.v.sizes());
  TORCH_CHECK_VALUE(static_cast<int64_t>(a.kv_map.size()) == a.q.size(1),
                    "math_attention: kv_map must have one entry per query head (", a.q.size(1),
                    "); got ", a.kv_map.size());
  const auto compute = a.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const double scale = a.scale > 0 ? a.scale : 1.0 / std::sqrt(static_cast<double>(a.q.size(-1)));
  at::Tensor map = at::tensor(a.kv_map, a.k.options().dtype(at::kLong));
  at::Tensor k = a.k.index_select(1, map).to(compute);
  at::Tensor v = a.v.index_select(1, map).to(compute);
  at::Tensor s = at::matmul(a.q.to(compute), k.transpose(-1, -2)) * scale;  // [B, H, S, S]
  if (a.softcap > 0) s = at::tanh(s / a.softcap) * a.softcap;  // Before any mask (Gemma2's).
  const int64_t Sq = s.size(-2), Sk = s.size(-1);
  at::Tensor allowed = at::ones({1, 1, Sq, Sk}, s.options().dtype(at::kBool));
  if (a.mask) {
    if (a.mask->scalar_type() == at::kBool) {
      allowed = allowed.logical_and(*a.mask);
    } else {
      s = s + a.mask->to(compute);
    }
  }
  if (auto rule = structure_mask(a)) allowed = allowed.logical_and(*rule);
  s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  if (a.sinks) {  // One more column per row: the head's sink logit, whose value is 0.
    at::Tensor sink = a.sinks->to(compute).view({1, -1, 1, 1}).expand({s.size(0), -1, Sq, 1});
    s = at::cat({s, sink}, -1);
    v = at::cat({v, at::zeros({v.size(0), v.size(1), 1, v.size(3)}, v.options())}, -2);
  }
  // Softmax that yields 0 (not NaN) for rows with no allowed key, gradients included.
  at::Tensor row_max = std::get<0>(s.max(-1, true)).detach();
  row_max = row_max.masked_fill(row_max.isinf(), 0);
  at::Tensor p = (s - row_max).exp();
  at::Tensor denom = p.sum(-1, true);
  p = p / denom.masked_fill(denom.eq(0), 1);
  return at::matmul(p, v).to(a.q.scalar_type());
}

namespace {

// `mask` (bool or additive, or none) further restricted to the `allowed` positions.
at::Tensor restrict_mask(const c10::optional<at::Tensor>& mask, const at::Tensor& allowed) {
  if (!mask) return allowed;
  if (mask->scalar_type() == at::kBool) return mask->logical_and(allowed);
  return mask->masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
}

constexpr const char* kKernelNames[] = {"auto", "fused", "sdpa", "math", "flex"};

// No mask and no rule but (optionally) causal: what SDPA computes without a mask.
bool plain_rules(const LocalAttentionArgs& a) {
  return !a.mask && !a.positions && !a.rows && a.window == 0;
}

// True when kv_map[h] == h / (Hq_r / Hkv) for every local query head h.
bool grouped_kv_map(const std::vector<int64_t>& kv_map, int64_t kv_heads) {
  const auto Hq = static_cast<int64_t>(kv_map.size());
  if (kv_heads < 1 || Hq % kv_heads != 0) return false;
  for (int64_t h = 0; h < Hq; ++h) {
    if (kv_map[h] != h / (Hq / kv_heads)) return false;
  }
  return true;
}
}  // namespace

at::Tensor sdpa_attention(const LocalAttentionArgs& a) {
  TORCH_CHECK_VALUE(a.softcap == 0, "local attention \"sdpa\" has no logit softcap; use \"auto\", ",
                    "\"fused\" or \"math\" with softcap=", a.softcap);
  TORCH_CHECK_VALUE(!a.sinks, "local attention \"sdpa\" has no attention sinks; use \"auto\", ",
                    "\"fused\" or \"math\"");
  // A grouped map (query head h reads kv head h / (Hq_r / Hkv_r)) is SDPA's own GQA: k and v
  // are read as they are. Any other map (uneven head splits) selects each query head's kv head.
  const bool grouped = grouped_kv_map(a.kv_map, a.k.size(1));
  at::Tensor k = a.k, v = a.v;
  if (!grouped) {
    at::Tensor map = at::tensor(a.kv_map, a.q.options().dtype(at::kLong));
    k = a.k.index_select(1, map), v = a.v.index_select(1, map);
  }
  const bool gqa = grouped && k.size(1) != a.q.size(1);
  const c10::optional<double> scale =
      a.scale > 0 ? c10::optional<double>(a.scale) : c10::optional<double>();
  // SDPA takes a mask or is_causal, not both: the rules become a mask unless causal is alone.
  if (plain_rules(a)) {
    return at::scaled_dot_product_attention(a.q, k, v, {}, 0.0, a.causal, scale, gqa);
  }
  c10::optional<at::Tensor> mask = a.mask;
  if (auto rule = structure_mask(a)) mask = restrict_mask(mask, *rule);
  return at::scaled_dot_product_attention(a.q, k, v, mask, 0.0, false, scale, gqa);
}

LocalKernel parse_local_kernel(const std::string& name) {
  for (LocalKernel k : local_kernels())
    if (name == kKernelNames[static_cast<int>(k)]) return k;
  TORCH_CHECK_VALUE(false, "local attention must be \"auto\", \"fused\", \"sdpa\", \"math\" ",
                    "or \"flex\" (or a callable, from Python); got \"", name, "\"");
}

std::string to_string(LocalKernel kernel) { return kKernelNames[static_cast<int>(kernel)]; }

std::vector<LocalKernel> local_kernels() {
  return {LocalKernel::kAuto, LocalKernel::kFused, LocalKernel::kSdpa, LocalKernel::kMath,
          LocalKernel::kFlex};
}

KernelCase KernelCase::of(const LocalAttentionArgs& a) {
  KernelCase c;
  c.device = a.q.device().type();
  c.dtype = a.q.scalar_type();
  c.mask = a.mask.has_value();
  c.documents = a.positions.has_value() || a.rows.has_value();
  c.window = a.window;
  c.softcap = a.softcap;
  c.sinks = a.sinks.has_value();
  return c;
}

LocalKernel choose_local_kernel(const KernelCase& c, LocalKernel requested) {
  const bool cpu = c.device == c10::DeviceType::CPU, fp64 = c.dtype == at::kDouble;
  if (requested == LocalKernel::kFused) {
    TORCH_CHECK_VALUE(cpu, "local attention \"fused\" runs on CPU tensors; got ",
                      c10::DeviceTypeName(c.device, /*lower_case=*/true),
                      ": use \"auto\" or \"sdpa\" there");
    TORCH_CHECK_VALUE(!fp64, "local attention \"fused\" computes fp32, bf16 and fp16 (in fp32); ",
                      "for fp64 use \"auto\" or \"math\" (exact in fp64)");
  }
  if (requested != LocalKernel::kAuto) return requested;
  if (cpu) {
    if (fp64) return LocalKernel::kMath;
    // Ours is the faster for fp32 and fp16 (sdpa_over_fused >= 1 from S = 256 to 8192; SDPA's
    // fp16 is ~8x slower still) and for bf16 where it multiplies in bf16 (AVX512-BF16), and it
    // skips what rules exclude. bf16 with no rule on a CPU without AVX512-BF16: SDPA, whose
    // bf16 GEMMs (oneDNN) beat our fp32 compute there.
    const bool sdpa_case = c.dtype == at::kBFloat16 && !flash_attention_bf16_gemm() && c.plain();
    return sdpa_case ? LocalKernel::kSdpa : LocalKernel::kFused;
  }
  if (c.device == c10::DeviceType::CUDA) return c.plain() ? LocalKernel::kSdpa : LocalKernel::kFlex;
  return c.softcap > 0 || c.sinks ? LocalKernel::kMath : LocalKernel::kSdpa;  // SDPA has neither.
}

LocalKernel choose_local_kernel(const LocalAttentionArgs& a, LocalKernel requested) {
  return choose_local_kernel(KernelCase::of(a), requested);
}

LocalKernel kernel_run_by_cpp(LocalKernel chosen, const KernelCase& c) {
  if (chosen != LocalKernel::kFlex) return chosen;
  if (c.device == c10::DeviceType::CPU)
    return c.dtype == at::kDouble ? LocalKernel::kMath : LocalKernel::kFused;
  return c.softcap > 0 || c.sinks ? LocalKernel::kMath : LocalKernel::kSdpa;
}

SquareBuffer square_buffer_off_cpu(const KernelCase& c, LocalKernel requested) {
  if (c.device == c10::DeviceType::CPU) return SquareBuffer::kNone;
  const LocalKernel run = kernel_run_by_cpp(choose_local_kernel(c, requested), c);
  if (run == LocalKernel::kMath) return SquareBuffer::kScores;
  const bool rules = c.documents || c.window > 0;  // SDPA builds their mask; a given one is used.
  return run == LocalKernel::kSdpa && rules ? SquareBuffer::kRuleMask : SquareBuffer::kNone;
}

int64_t square_buffer_bytes(SquareBuffer buffer, int64_t batch, int64_t heads, int64_t seq_len) {
  switch (buffer) {
    case SquareBuffer::kScores:
      return batch * heads * seq_len * seq_len * 4;
    case SquareBuffer::kRuleMask:
      return batch * seq_len * seq_len * 4;
    default:
      return 0;
  }
}

namespace {
// Note [No silent S x S] for a local attention call run alone (an attention call was checked in
// its agreement already, alike on every rank).
void check_square_buffer(const LocalAttentionArgs& a, LocalKernel requested) {
  const KernelCase c = KernelCase::of(a);
  const SquareBuffer buffer = square_buffer_off_cpu(c, requested);
  const int64_t S = std::max(a.q.size(-2), a.k.size(-2));
  const int64_t bytes = square_buffer_bytes(buffer, a.q.size(0), a.q.size(1), S);
  TORCH_CHECK_VALUE(bytes <= kSquareMaxBytes, "local attention: off the CPU C++ would run ",
                    buffer == SquareBuffer::kScores ? "the math kernel, whose fp32 scores"
                                                    : "SDPA with the rules as a dense mask, which",
                    " [B=", a.q.size(0), ", S=", S, ", S] take ", bytes,
                    " bytes, above the bound of ", kSquareMaxBytes,
                    " (Note [No silent S x S]); run it from Python (FlexAttention, ulysses.flex), "
                    "or on a shorter sequence");
}
}  // namespace

at::Tensor local_attention(const LocalAttentionArgs& args, LocalKernel kernel) {
  check_softcap(args.softcap);
  check_sinks(args.sinks, args.q.size(1));
  check_square_buffer(args, kernel);
  switch (kernel_run_by_cpp(choose_local_kernel(args, kernel), KernelCase::of(args))) {
    case LocalKernel::kFused:
      return flash_attention(args);
    case LocalKernel::kSdpa:
      return sdpa_attention(args);
    default:
      return math_attention(args);
  }
}

void check_sinks(const c10::optional<at::Tensor>& sinks, int64_t q_heads) {
  if (!sinks || !sinks->defined()) return;
  TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->size(0) == q_heads && sinks->is_floating_point(),
                    "attention: sinks must be a floating-point [q_heads] = [", q_heads,
                    "] tensor (one logit per query head); got ", sinks->scalar_type(), " ",
                    sinks->sizes());
}

}  // namespace ulysses
