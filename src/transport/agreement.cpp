// The call's agreement: every rank's local checks and its CallFingerprint, moved in one small
// collective before any data (agree_plan), so a mistake anywhere raises the same error on
// every rank.
#include "transport/agreement.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "plan/fnv1a.h"
#include "transport/environment.h"
#include "transport/transfers.h"
#include "ulysses/attention.h"
#include "ulysses/mask_decision.h"

namespace ulysses {
namespace {

using detail::shape_str;

}  // namespace

void check_4d(const std::vector<TensorSpec>& tensors, Layout layout) {
  for (const TensorSpec& spec : tensors) {
    const at::Tensor& x = spec.tensor;
    TORCH_CHECK_VALUE(x.defined() && x.dim() == 4, "agree_plan: ", spec.name,
                      " must be a 4-D tensor in layout ", to_string(layout), "; got ",
                      x.defined() ? shape_str(x.sizes()) : "undefined");
  }
}

namespace {

TensorFacts facts_of(const c10::optional<at::Tensor>& t, const at::Tensor& first) {
  TensorFacts f;
  if (!t || !t->defined()) return f;
  f.given = true;
  f.sizes = t->sizes().vec();
  f.dtype = static_cast<int64_t>(t->scalar_type());
  f.device_type = static_cast<int64_t>(t->device().type());
  f.on_first_device = t->device() == first.device();
  f.requires_grad = t->requires_grad();
  return f;
}

// This rank's checks of one call, before any collective: raises naming the argument.
void check_call_locally(const HeadPartition& heads, Layout layout,
                        const std::vector<TensorSpec>& tensors, const CallOptions& call, int P) {
  const int64_t sdim = seq_dim(layout), hdim = head_dim(layout), bdim = batch_dim(layout);
  TORCH_CHECK_VALUE(!tensors.empty(), "agree_plan: need at least one tensor");
  TORCH_CHECK_VALUE(heads.sp_size() == P, "agree_plan: head partition is for ", heads.sp_size(),
                    " ranks but the SP group has ", P);
  check_4d(tensors, layout);
  call.check();
  check_sinks(call.sinks, heads.q_heads());
  const at::Tensor& first = tensors[0].tensor;
  for (const TensorSpec& spec : tensors) {
    const at::Tensor& x = spec.tensor;
    TORCH_CHECK_TYPE(x.is_floating_point(), "agree_plan: ", spec.name,
                     " must be floating point (fp32, bf16, fp16, fp64); got ", x.scalar_type());
    TORCH_CHECK_TYPE(x.scalar_type() == first.scalar_type(), "agree_plan: ", spec.name, " is ",
                     x.scalar_type(), " but ", tensors[0].name, " is ", first.scalar_type(),
                     "; give them one dtype");
    TORCH_CHECK_VALUE(x.device() == first.device(), "agree_plan: ", spec.name, " is on ",
                      x.device(), " but ", tensors[0].name, " is on ", first.device(),
                      "; move them to one device");
    for (int64_t d = 0; d < 4; ++d) {
      TORCH_CHECK_VALUE(d == sdim || x.size(d) >= 1, "agree_plan: ", spec.name, " has shape ",
                        shape_str(x.sizes()), "; every dim but the sequence dim ", sdim,
                        " must be >= 1 (layout ", to_string(layout), ")");
    }
    const int64_t want = spec.heads == Heads::kQuery ? heads.q_heads() : heads.kv_heads();
    TORCH_CHECK_VALUE(x.size(hdim) == want, "agree_plan: ", spec.name, " must have ", want, " ",
                      heads_word(spec.heads), " heads in dim ", hdim, " (layout ",
                      to_string(layout), "); got shape ", shape_str(x.sizes()));
    TORCH_CHECK_VALUE(x.size(sdim) == first.size(sdim), "agree_plan: ", spec.name, " has ",
                      x.size(sdim), " tokens but ", tensors[0].name, " has ", first.size(sdim));
    TORCH_CHECK_VALUE(x.size(bdim) == first.size(bdim), "agree_plan: ", spec.name, " has batch ",
                      x.size(bdim), " but ", tensors[0].name, " has batch ", first.size(bdim),
                      " (shapes ", shape_str(x.sizes()), " and ", shape_str(first.sizes()), ")");
  }
  // The mask and position ids go to collectives beside q (their rebuild and gather), and
  // the sinks to q's kernel: on another device they would reach a backend without it (NCCL
  // has no CPU tensors). Refused here, before any collective, naming the device to use.
  const std::pair<const char*, const c10::optional<at::Tensor>*> extras[] = {
      {"mask", &call.mask}, {"position_ids", &call.positions}, {"sinks", &call.sinks}};
  for (const auto& [name, t] : extras) {
    TORCH_CHECK_VALUE(!*t || !(*t)->defined() || (*t)->device() == first.device(),
                      "agree_plan: ", name, " is on ", (*t)->device(), " but ", tensors[0].name,
                      " is on ", first.device(), "; move it to ", first.device());
  }
  TORCH_CHECK_VALUE(call.cpu_only == nullptr || first.is_cpu(), "agree_plan: ", call.cpu_only,
                    " runs on CPU tensors; ", tensors[0].name, " is on ", first.device(),
                    ": use local=\"auto\" (SDPA) there");
  if (call.attention) {  // q, k, v: k's head dim is q's (v's may differ).
    TORCH_CHECK_VALUE(tensors.size() == 3 && tensors[1].tensor.size(3) == first.size(3),
                      "agree_plan: q and k must have one head dim; got q ",
                      shape_str(first.sizes()), " and k ", shape_str(tensors[1].tensor.sizes()),
                      " (layout ", to_string(layout), ")");
  }
  const int64_t B = first.size(bdim), tokens = first.size(sdim);
  if (call.mask) {
    const at::Tensor& m = *call.mask;
    TORCH_CHECK_TYPE(m.scalar_type() == at::kBool || m.is_floating_point(),
                     "agree_plan: mask must be bool (true = attend) or an additive float mask; "
                     "got ",
                     m.scalar_type());
    TORCH_CHECK_VALUE(m.dim() >= 2 && m.dim() <= 4,
                      "agree_plan: mask must be 2-D [Sq, Sk], 3-D [heads, Sq, Sk] or 4-D [B, "
                      "heads, Sq, Sk]; got ",
                      shape_str(m.sizes()));
    const auto s = mask_sizes_4d(m.sizes().vec(), "mask");
    TORCH_CHECK_VALUE(s[0] == 1 || s[0] == B, "agree_plan: mask has shape ", shape_str(m.sizes()),
                      ": its batch dim must be 1 or B = ", B, " (q is ", shape_str(first.sizes()),
                      ")");
  }
  if (call.positions) {
    const at::Tensor& p = *call.positions;
    TORCH_CHECK_TYPE(!p.is_floating_point() && p.scalar_type() != at::kBool,
                     "agree_plan: position_ids must be integers; got ", p.scalar_type());
    TORCH_CHECK_VALUE(p.dim() == 2 && p.size(0) == B && p.size(1) == tokens,
                      "agree_plan: position_ids must be [B, S_r] = [", B, ", ", tokens,
                      "] or [S_r] (this shard's positions); got ", shape_str(p.sizes()));
  }
}

}  // namespace

c10::optional<at::Tensor> positions_for_call(const c10::optional<at::Tensor>& positions,
                                             const at::Tensor& q, Layout layout) {
  if (!positions || positions->dim() != 1 || q.dim() != 4) return positions;
  return positions->unsqueeze(0).expand({q.size(batch_dim(layout)), positions->size(0)});
}

CallFingerprint call_fingerprint(const Group& group, const HeadPartition& heads, Layout layout,
                                 const std::vector<TensorSpec>& tensors,
                                 const c10::optional<SequencePartition>& seq,
                                 const CallOptions& call) {
  check_call_locally(heads, layout, tensors, call, group.size());
  const at::Tensor& first = tensors[0].tensor;
  CallFingerprint f;
  f.q_heads = heads.q_heads();
  f.kv_heads = heads.kv_heads();
  f.sp_size = group.size();
  f.layout = static_cast<int64_t>(layout);
  f.seq_split = seq ? Fnv1a().add(seq->lengths()).non_negative() : -1;  // Compared as a hash.
  // How the exchanges run depends on the group handle's options: ranks that differ would take
  // different paths (or cut messages differently) and wait on each other.
  f.pipeline_min_bytes = group.options().pipeline_min_bytes;
  f.message_bytes = group.options().message_bytes;
  f.shared_memory = uses_shared_memory(group.options());
  f.batched = batches(group, first.device().type());
  for (const TensorSpec& spec : tensors) f.tensors.push_back(facts_of(spec.tensor, first));
  f.mask = facts_of(call.mask, first);
  f.positions = facts_of(call.positions, first);
  f.rules() = call.rules();
  f.sinks = facts_of(call.sinks, first);
  f.step_context = call.step_context;
  f.reuses_agreement = call.reuses_agreement;
  if (call.local_kernel >= 0) {  // C++ runs the local attention: Note [No silent S x S].
    KernelCase c;
    c.device = first.device().type();
    c.dtype = first.scalar_type();
    c.mask = call.mask.has_value();
    c.documents = call.positions.has_value();
    c.window = call.window;
    c.softcap = call.softcap;
    c.sinks = call.sinks.has_value();
    f.square_off_cpu =
        static_cast<int64_t>(square_buffer_off_cpu(c, static_cast<LocalKernel>(call.local_kernel)));
  }
  return f;
}

namespace {

// Note [No silent S x S] (attention.h): off the CPU, an attention call whose local attention C++
// would run on an S x S buffer of more than kSquareMaxBytes on its largest rank is refused.
// Every fact read here was agreed, so every rank raises the same error.
void check_square_buffer(const CallFingerprint& f, const HeadPartition& heads,
                         const SequencePartition& seq, Layout layout) {
  const auto buffer = static_cast<SquareBuffer>(f.square_off_cpu);
  if (buffer == SquareBuffer::kNone) return;
  const TensorFacts& q = f.tensors[0];
  int64_t most_heads = 0;
  for (int r = 0; r < heads.sp_size(); ++r)
    most_heads = std::max(most_heads, heads.q_range(r).size());
  const int64_t S = seq.seq_len(), B = q.sizes[batch_dim(layout)];
  const int64_t bytes = square_buffer_bytes(buffer, B, most_heads, S);
  if (buffer == SquareBuffer::kScores) {
    const char* why = f.softcap > 0   ? "SDPA has no softcap"
                      : f.sinks.given ? "SDPA has no sinks"
                                      : "local=\"math\" was asked for";
    TORCH_CHECK_VALUE(bytes <= kSquareMaxBytes,
                      "DistributedAttention: off the CPU this call would run the math kernel (",
                      why, "), whose fp32 scores [B=", B, ", heads=", most_heads, ", S=", S,
                      ", S] take ", bytes, " bytes, above its bound of ", kSquareMaxBytes,
                      " (Note [No silent S x S]); use local=\"flex\" (Python: FlexAttention, a "
                      "softcap and sinks as a score function), a shorter sequence, or more ranks");
  }
  TORCH_CHECK_VALUE(bytes <= kSquareMaxBytes,
                    "DistributedAttention: off the CPU the C++ API would run this call on SDPA "
                    "with its causal, window and document rules as a dense mask [B=",
                    B, ", 1, S=", S, ", S] of ", bytes, " bytes, above its bound of ",
                    kSquareMaxBytes,
                    " (Note [No silent S x S]); the rule picks FlexAttention there, which "
                    "Python's ulysses.DistributedAttention runs: call it from Python, or run a "
                    "shorter sequence or more ranks");
}

}  // namespace

Sharding agree_plan(const Group& group, const HeadPartition& heads, Layout layout,
                    const std::vector<TensorSpec>& tensors,
                    const c10::optional<SequencePartition>& seq) {
  return agree_plan(group, heads, layout, tensors, seq, CallOptions{});
}

Sharding agree_plan(const Group& group, const HeadPartition& heads, Layout layout,
                    const std::vector<TensorSpec>& tensors,
                    const c10::optional<SequencePartition>& seq, const CallOptions& call) {
  const int P = group.size();
  const int64_t sdim = seq_dim(layout);
  auto all = group.agree(
      [&]() {
        TORCH_CHECK_VALUE(!seq || seq->sp_size() == P, "agree_plan: the given sequence split ",
                          *seq, " is for ", seq ? seq->sp_size() : 0,
                          " ranks but the SP group has ", P);
        return call_fingerprint(group, heads, layout, tensors, seq, call).encode();
      },
      "the call (agree_plan)");

  // Every rank now checks the same gathered data, so every rank raises the same error.
  std::vector<CallFingerprint> prints;
  for (const auto& m : all) prints.push_back(CallFingerprint::decode(m));
  std::vector<std::string> names;
  for (const TensorSpec& spec : tensors) names.push_back(spec.name);
  check_alike(prints, names, "agree_plan: ");
  std::vector<int64_t> lengths;
  for (const CallFingerprint& f : prints) lengths.push_back(f.tensors[0].sizes[sdim]);
  if (seq) {
    TORCH_CHECK_VALUE(seq->lengths() == lengths, "agree_plan: local sequence lengths ",
                      SequencePartition::from_lengths(lengths), " do not match the given ", *seq,
                      " (seq_lens)");
  }
  const SequencePartition agreed = SequencePartition::from_lengths(lengths);
  if (call.mask && call.mask_check == CallOptions::MaskCheck::kAgreement) {
    std::vector<std::array<int64_t, 4>> sizes;
    for (const CallFingerprint& f : prints) sizes.push_back(mask_sizes_4d(f.mask.sizes, "mask"));
    check_mask_shapes(sizes, prints[0].tensors[0].sizes[batch_dim(layout)], heads.q_heads(), agreed,
                      "mask");
  }
  check_square_buffer(prints[0], heads, agreed, layout);
  return Sharding{heads, agreed, layout};
}

void detail::ArmedAgreement::remember(const Sharding& sharding, const std::vector<at::Tensor>& qkv,
                                      const std::vector<int64_t>& call) {
  if (misses_in_a_row_ >= kMaxMissesInARow) return;  // Stopped arming.
  std::vector<std::vector<int64_t>> sizes;
  for (const at::Tensor& t : qkv) sizes.push_back(t.sizes().vec());
  // Every fact compared here was agreed (the sharding, dtype, q, k, v's dims but the sequence's,
  // whose lengths the sharding holds), so every rank keeps or replaces alike.
  const bool same = exchange_ && exchange_->sharding.heads == sharding.heads &&
                    exchange_->sharding.seq == sharding.seq &&
                    exchange_->sharding.layout == sharding.layout && exchange_->sizes == sizes &&
                    exchange_->dtype == qkv[0].scalar_type() && exchange_->calls.size() < kMaxCalls;
  if (!same) exchange_ = Exchange{sharding, sizes, qkv[0].scalar_type(), {}};
  exchange_->calls.push_back(call);
}

}  // namespace ulysses
