#include "ulysses/distributed_attention.h"

#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "attention/ops.h"
#include "attention/orchestration.h"
#include "dispatch/autograd.h"
#include "dispatch/op_util.h"
#include "kernels/ops.h"
#include "transport/agreement.h"
#include "transport/environment.h"
#include "transport/exchange.h"
#include "transport/group_runtime.h"
#include "transport/head_parts.h"
#include "transport/ops.h"
#include "ulysses/attention.h"
#include "ulysses/flash_attention.h"
#include "ulysses/mask.h"
#include "ulysses/mask_decision.h"

namespace ulysses {

bool StepContext::Key::matches(const Key& other) const {
  return kind == other.kind && source.is_same(other.source) && version == other.version &&
         q_ranges == other.q_ranges && seq_lengths == other.seq_lengths && keys == other.keys;
}

at::Tensor StepContext::once(Key key, const std::function<at::Tensor()>& build) {
  key.version = static_cast<int64_t>(key.source._version());
  for (const auto& [held, result] : cache_) {
    if (held.matches(key)) {
      if (key.kind != Key::Kind::kSplitsDocuments) ++reuses_;  // A collective saved.
      return result;
    }
  }
  cache_.emplace_back(std::move(key), build());
  return cache_.back().second;
}

at::Tensor StepContext::rebuilt_mask(const at::Tensor& mask, const Sharding& sharding,
                                     const RingLayout* layout, int64_t sp_rank) {
  // A head-shared mask does not depend on the head split: one entry serves every instance.
  const bool shared = mask_shared_across_heads(mask.sizes().vec());
  std::vector<Range> heads = shared ? std::vector<Range>{} : sharding.heads.q_ranges();
  if (layout) {
    // Which rows a ring rank's mask holds depends on its SP rank: part of the key.
    heads.push_back({sp_rank, sp_rank});
    return once({Key::Kind::kMask, mask, 0, heads, sharding.seq.lengths(), layout->seq_len()},
                [&] { return rebuild_ring_mask(mask, sharding, *layout, sp_rank, group_); });
  }
  return once({Key::Kind::kMask, mask, 0, heads, sharding.seq.lengths()},
              [&] { return rebuild_mask(mask, sharding, group_); });
}

at::Tensor StepContext::gathered_positions(const at::Tensor& positions,
                                           const SequencePartition& seq) {
  return once({Key::Kind::kPositions, positions, 0, {}, seq.lengths()},
              [&] { return all_gather_sequence(positions, -1, seq, group_); });
}

at::Tensor StepContext::ring_documents(const at::Tensor& positions, const RingLayout& layout,
                                       const Group& ring) {
  return once(
      {Key::Kind::kRingDocuments, positions, 0, {}, layout.ring_lengths(), layout.seq_len()},
      [&] { return ring_document_ids(positions, layout, ring); });
}

bool StepContext::splits_documents(const at::Tensor& positions) {
  return once({Key::Kind::kSplitsDocuments, positions},
              [&] { return at::scalar_tensor(ulysses::splits_documents(positions), at::kBool); })
      .item<bool>();
}

// The orchestration's access to a StepContext's counter of skipped agreement rounds.
struct StepContextAccess {
  static void count_agreement_reused(StepContext& step) { ++step.agreements_reused_; }
};

namespace {

// Every ring rank must run the same ring: the ring ranks agree on the call's fingerprint (as the
// Ulysses ranks did, but for the split, which differs between Ulysses groups) and learn each
// ring rank's token count (the zigzag layout fixes them once S is known). Before data moves.
RingLayout agree_ring(const AttentionCall& call, const Sharding& sharding,
                      const std::vector<TensorSpec>& specs, const CallOptions& options,
                      const c10::optional<at::Tensor>& mask) {
  const Group& ring = call.ring;
  auto all = ring.agree(
      [&] {
        check_ring_kernel(call.local ? c10::nullopt : c10::optional<LocalKernel>(call.kernel));
        CallFingerprint f = call_fingerprint(call.group, sharding.heads, sharding.layout, specs,
                                             c10::nullopt, options);
        std::vector<int64_t> m{sharding.seq.seq_len()};
        const std::vector<int64_t> fingerprint = f.encode();
        m.insert(m.end(), fingerprint.begin(), fingerprint.end());
        return m;
      },
      "the ring's call (DistributedAttention)");
  std::vector<CallFingerprint> prints;
  int64_t S = 0;
  for (const auto& m : all) {
    S += m[0];
    prints.push_back(CallFingerprint::decode({m.begin() + 1, m.end()}));
  }
  std::vector<std::string> names;
  for (const TensorSpec& spec : specs) names.push_back(spec.name);
  check_alike(prints, names, "DistributedAttention (ring): ");
  const RingLayout layout = RingLayout::make(S, call.group.size(), ring.size());
  for (int r = 0; r < ring.size(); ++r) {
    TORCH_CHECK_VALUE(all[r][0] == layout.ring_length(r), "DistributedAttention: ring rank ", r,
                      "'s Ulysses group holds ", all[r][0], " tokens; the zigzag layout of ", S,
                      " tokens gives it ", layout.ring_length(r),
                      " (shard inputs with RingLayout::shard / ulysses.shard_sequence)");
  }
  if (mask) {  // Rows: this shard's, all S or 1; keys: all S (global order) or 1.
    std::vector<std::array<int64_t, 4>> sizes;
    for (const CallFingerprint& f : prints) sizes.push_back(mask_sizes_4d(f.mask.sizes, "mask"));
    for (int r = 0; r < ring.size(); ++r) {
      const int64_t shard = layout.shard_index(r * call.group.size() + call.group.rank()).numel();
      const int64_t rows = sizes[r][2], keys = sizes[r][3];
      TORCH_CHECK_VALUE((rows == shard || rows == S || rows == 1) && (keys == S || keys == 1),
                        "DistributedAttention: with a ring, a mask's query rows must be this "
                        "rank's ",
                        shard, " tokens, all ", S, " or 1, and its keys all ", S,
                        " (in global order) or 1; ring rank ", r, "'s mask is [", sizes[r][0], ", ",
                        sizes[r][1], ", ", rows, ", ", keys, "]");
    }
  }
  return layout;
}

// q, k and v (whole tensors, or stand-ins for their parts) with their names for agree_plan.
std::vector<TensorSpec> specs_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return {{q, Heads::kQuery, "q"}, {k, Heads::kKeyValue, "k"}, {v, Heads::kKeyValue, "v"}};
}

const std::vector<Heads> kQKV{Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue};

int64_t heads_of(const at::Tensor& t, Layout layout) {
  return t.defined() && t.dim() == 4 ? t.size(head_dim(layout)) : 0;
}

// The exchange when some collective runs outside an op (a split to learn, a ring, unfused
// exchanges; eager only): agree_plan (and the ring's agreement), then the API's exchanges.
std::vector<at::Tensor> agree_and_exchange(
    const AttentionCall& call, const std::vector<std::vector<at::Tensor>>& qkv, HeadForm form,
    int64_t hq, int64_t hkv, CallOptions& options, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& positions, c10::optional<Sharding>& sharding,
    c10::optional<RingLayout>& ring_layout) {
  const Group& group = call.group;
  const Layout L = call.layout;
  const bool ring = call.ring.size() > 1, parts = form == HeadForm::kParts;
  std::vector<at::Tensor> heads;
  std::vector<TensorSpec> specs;
  const HeadPartition partition = fail_together_on_error(group, [&] {
    if (!parts) check_4d(specs_of(qkv[0][0], qkv[1][0], qkv[2][0]), L);
    HeadPartition p = HeadPartition::make(hq, hkv, group.size());
    if (parts) {
      const std::string who = "DistributedAttention::forward_parts: ";
      specs = specs_of(stand_in_for_parts(qkv[0], Heads::kQuery, p, L, who + "q"),
                       stand_in_for_parts(qkv[1], Heads::kKeyValue, p, L, who + "k"),
                       stand_in_for_parts(qkv[2], Heads::kKeyValue, p, L, who + "v"));
    } else {
      specs = specs_of(qkv[0][0], qkv[1][0], qkv[2][0]);
    }
    return p;
  });
  if (parts) options.positions = positions_for_call(positions, specs[0].tensor, L);
  sharding = agree_plan(group, partition, L, specs, call.seq, options);
  if (ring) {
    // A ring group that refuses the call fails its Ulysses groups too (and through them every
    // rank of the SP group), with the same text: no rank is left waiting in an all-to-all.
    std::exception_ptr refused;
    try {
      ring_layout = agree_ring(call, *sharding, specs, options, mask);
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    group.agree(
        [&] {
          if (refused) std::rethrow_exception(refused);
          return std::vector<int64_t>{};
        },
        "the ring's outcome (DistributedAttention)");
  }
  if (parts && call.exchange == QkvExchange::kFused) {
    heads = scatter_head_parts(qkv, kQKV, *sharding, group);
  } else if (parts) {
    for (size_t i = 0; i < 3; ++i)
      heads.push_back(scatter_head_parts(qkv[i], kQKV[i], *sharding, group));
  } else if (call.exchange == QkvExchange::kFused) {
    heads = scatter_heads({qkv[0][0], qkv[1][0], qkv[2][0]}, kQKV, *sharding, group);
  } else {
    for (size_t i = 0; i < 3; ++i)
      heads.push_back(scatter_heads(qkv[i][0], kQKV[i], *sharding, group));
  }
  return heads;
}

// Whether `t` has values the host can read: not a tensor being traced (a fake or functional
// tensor of torch.compile) and not on the meta device.
bool readable_on_host(const at::Tensor& t) {
  return !t.is_meta() && !t.unsafeGetTensorImpl()->is_python_dispatch() &&
         !at::functionalization::impl::isFunctionalTensor(t);
}

// Whether a call just agreed may arm its group: facts every rank agreed on, alike everywhere
// (Note [Reused agreement]).
bool may_reuse(const CallOptions& options, const Sharding& sharding, const at::Tensor& q) {
  const auto& lengths = sharding.seq.lengths();
  const bool every_rank_has_tokens =
      std::all_of(lengths.begin(), lengths.end(), [](int64_t n) { return n > 0; });
  const at::ScalarType t = q.scalar_type();
  return options.reuses_agreement && sharding.heads.sp_size() > 1 && q.is_cpu() &&
         every_rank_has_tokens &&
         (t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf);
}

// This rank's fingerprint of a call of whole q, k, v (raises as the agreement's local checks).
std::vector<int64_t> whole_fingerprint(const AttentionCall& call,
                                       const std::vector<std::vector<at::Tensor>>& qkv, int64_t hq,
                                       int64_t hkv, const CallOptions& options) {
  const HeadPartition heads = HeadPartition::make(hq, hkv, call.group.size());
  return call_fingerprint(call.group, heads, call.layout, specs_of(qkv[0][0], qkv[1][0], qkv[2][0]),
                          call.seq, options)
      .encode();
}

// The exchange by the group's armed sharding with this rank's `index` fused in (Note [Reused
// agreement]): `qkv` when index > 0, else zeros of the agreed sizes. Returns q, k, v by heads
// when every rank's index was the same nonzero one, else nothing (every rank alike).
c10::optional<std::vector<at::Tensor>> move_as_armed(const Group& group,
                                                     detail::ArmedAgreement& armed,
                                                     const std::vector<at::Tensor>& qkv,
                                                     int64_t index) {
  const detail::ArmedAgreement::Exchange& agreed = *armed.armed();
  const at::TensorOptions like = at::TensorOptions().dtype(agreed.dtype);
  std::vector<at::Tensor> xs;
  for (size_t t = 0; t < 3; ++t) {  // A call that differs sends zeros of the agreed sizes.
    xs.push_back(index > 0 ? qkv[t] : at::zeros(agreed.sizes[t], like));
  }
  std::vector<int64_t> flag_sizes = agreed.sizes[1];
  flag_sizes[3] = 1;  // k's shape with one feature: every rank's index reaches every rank.
  xs.push_back(at::full(flag_sizes, static_cast<double>(index), like));
  std::vector<at::Tensor> out =
      scatter_heads(xs, {Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue, Heads::kKeyValue},
                    agreed.sharding, group);
  // Read without autograd: a checkpoint's recompute must save what the first run saved.
  const at::Tensor indexes = out[3].detach();
  const double low = indexes.min().item<double>(), high = indexes.max().item<double>();
  const bool reused = low == high && low > 0;
  armed.exchanged(reused);
  if (!reused) return c10::nullopt;
  out.pop_back();
  return out;
}

// The armed exchange of a call of whole q, k, v: its index is 1 + the position of its
// fingerprint among the agreed ones, or 0 (none, or its local checks raise: the full agreement
// then raises that, alike on every rank).
c10::optional<std::vector<at::Tensor>> exchange_as_agreed(
    const AttentionCall& call, const std::vector<std::vector<at::Tensor>>& qkv, int64_t hq,
    int64_t hkv, const CallOptions& options, detail::ArmedAgreement& armed) {
  int64_t index = 0;
  if (options.reuses_agreement) {
    try {
      const std::vector<int64_t> mine = whole_fingerprint(call, qkv, hq, hkv, options);
      const auto& calls = armed.armed()->calls;
      const auto at = std::find(calls.begin(), calls.end(), mine);
      if (at != calls.end()) index = 1 + (at - calls.begin());
    } catch (const std::exception&) {
      index = 0;
    }
  }
  return move_as_armed(call.group, armed, {qkv[0][0], qkv[1][0], qkv[2][0]}, index);
}

}  // namespace

void fail_attention_together(const Group& group, const std::exception_ptr& error) {
  detail::ArmedAgreement& armed = group.runtime().armed;
  if (armed.armed()) move_as_armed(group, armed, {}, 0);  // Where the others' calls start.
  group.fail_together(error);
}

AttentionHeads attend_heads(const AttentionCall& call,
                            const std::vector<std::vector<at::Tensor>>& qkv, HeadForm form,
                            const c10::optional<at::Tensor>& mask,
                            const c10::optional<at::Tensor>& positions) {
  const Group& group = call.group;
  const Layout L = call.layout;
  const bool ring = call.ring.size() > 1;
  TORCH_CHECK_VALUE(qkv.size() == 3, "attend: need q, k and v");
  TORCH_CHECK_VALUE(call.step == nullptr || call.step->group().size() == group.size(),
                    "DistributedAttention: the StepContext's group has ",
                    call.step ? call.step->group().size() : 0, " ranks but this attention's has ",
                    group.size());
  const int64_t hq = call.q_heads > 0           ? call.q_heads
                     : form == HeadForm::kParts ? 0
                                                : heads_of(qkv[0][0], L);
  const int64_t hkv = call.kv_heads > 0          ? call.kv_heads
                      : form == HeadForm::kParts ? 0
                                                 : heads_of(qkv[1][0], L);
  const at::Tensor& q0 = qkv[0].empty() ? at::Tensor() : qkv[0][0];
  CallOptions options;
  options.attention = true;
  options.mask = mask;
  options.positions = q0.defined() ? positions_for_call(positions, q0, L) : positions;
  options.rules() = call.rules();
  options.sinks = call.sinks;
  options.step_context = call.step != nullptr;
  options.reuses_agreement =
      call.step && form == HeadForm::kWhole && call.exchange == QkvExchange::kFused && !ring;
  if (!call.local && call.local_by == LocalBy::kLibrary && !ring)
    options.local_kernel = static_cast<int64_t>(call.kernel);
  if (ring) {
    options.cpu_only = "ring attention (its blocks run on the fused CPU kernel)";
  } else if (!call.local && call.kernel == LocalKernel::kFused) {
    options.cpu_only = "local attention \"fused\"";
  }
  // A ring's mask, and one already rebuilt, have other shapes than the agreement checks.
  if (ring || call.mask_form == MaskForm::kRebuilt)
    options.mask_check = CallOptions::MaskCheck::kCaller;

  c10::optional<Sharding> sharding;
  c10::optional<RingLayout> ring_layout;
  std::vector<at::Tensor> heads;
  StepContext* step = call.step;
  detail::ArmedAgreement& armed = group.runtime().armed;
  if (armed.armed()) {  // Alike on every rank: each moves by the armed sharding.
    if (auto moved = exchange_as_agreed(call, qkv, hq, hkv, options, armed)) {
      heads = std::move(*moved);
      sharding = armed.armed()->sharding;
      if (step) StepContextAccess::count_agreement_reused(*step);
    }
  }
  const bool agreed_now = !sharding;
  if (!sharding && call.seq && !ring && call.exchange == QkvExchange::kFused) {
    // Every collective inside an op: the scatter agrees on the call before data moves.
    heads = detail::call_scatter_agreed(qkv, form, kQKV, hq, hkv, *call.seq, L, group, options);
    sharding = Sharding{HeadPartition::make(hq, hkv, group.size()), *call.seq, L};
  } else if (!sharding) {
    heads = agree_and_exchange(call, qkv, form, hq, hkv, options, mask, positions, sharding,
                               ring_layout);
  }
  if (agreed_now && may_reuse(options, *sharding, q0)) {  // Later calls like this one reuse it.
    armed.remember(*sharding, {qkv[0][0], qkv[1][0], qkv[2][0]},
                   whole_fingerprint(call, qkv, hq, hkv, options));
  } else if (agreed_now) {
    armed.disarm();
  }
  AttentionHeads out{LocalAttentionArgs{}, *sharding, ring_layout, at::Tensor()};
  LocalAttentionArgs& args = out.args;
  const auto perm = to_bhsd(L);
  args.q = heads[0].permute(perm);
  args.k = heads[1].permute(perm);
  args.v = heads[2].permute(perm);
  args.kv_map = out.sharding.heads.kv_map(group.rank());
  args.set_rules(call.rules());
  if (call.sinks) {  // This rank's query heads' entries (Note [Attention sinks], ops.cpp).
    const Range r = out.sharding.heads.q_range(group.rank());
    args.sinks = call.sinks->slice(0, r.begin, r.end);
  }
  if (mask && call.mask_form == MaskForm::kRebuilt) {
    args.mask = mask;
  } else if (mask && ring) {  // Rows of this ring rank's queries, every key in global order.
    const int64_t sp_rank = call.ring.rank() * group.size() + group.rank();
    args.mask = step ? step->rebuilt_mask(*mask, out.sharding, &*out.ring, sp_rank)
                     : rebuild_ring_mask(*mask, out.sharding, *out.ring, sp_rank, group);
  } else if (mask) {
    args.mask =
        step ? step->rebuilt_mask(*mask, out.sharding) : rebuild_mask(*mask, out.sharding, group);
  }
  if (options.positions) {
    const at::Tensor& p = *options.positions;
    args.positions = step ? step->gathered_positions(p, out.sharding.seq)
                          : all_gather_sequence(p, -1, out.sharding.seq, group);
  }
  if (ring && args.positions) {
    out.ring_documents = step ? step->ring_documents(*args.positions, *out.ring, call.ring)
                              : ring_document_ids(*args.positions, *out.ring, call.ring);
    args.positions.reset();
  } else if (args.positions && readable_on_host(*args.positions)) {
    // Ids that split no row into documents add no rule: the kernel runs as if none were given
    // (no document mask on SDPA, no flex for them). Every rank gathered the same ids, so every
    // rank drops them. With a StepContext the gathered ids are one tensor for the step's
    // layers: read once. A traced call keeps them (its ids have no values to read).
    const bool splits =
        step ? step->splits_documents(*args.positions) : splits_documents(*args.positions);
    if (!splits) args.positions.reset();
  }
  return out;
}

namespace {

// attend's second half up to the exchange back: the ring, the caller's callable or the library's
// kernel on this rank's heads (BHSD).
at::Tensor attention_by_heads(const AttentionCall& call, const AttentionHeads& h) {
  if (h.ring) return ring_attention(h.args, *h.ring, h.ring_documents, call.ring);
  return call.local ? (*call.local)(h.args) : local_attention(h.args, call.kernel);
}

}  // namespace

std::vector<at::Tensor> attend(const AttentionCall& call,
                               const std::vector<std::vector<at::Tensor>>& qkv, HeadForm form,
                               const c10::optional<at::Tensor>& mask,
                               const c10::optional<at::Tensor>& positions) {
  AttentionHeads h = attend_heads(call, qkv, form, mask, positions);
  at::Tensor o = attention_by_heads(call, h).permute(from_bhsd(call.layout));
  if (form == HeadForm::kParts) return gather_head_parts(o, Heads::kQuery, h.sharding, call.group);
  return {gather_heads(o, Heads::kQuery, h.sharding, call.group)};
}

void check_attention_options(int64_t q_heads, int64_t kv_heads, const AttentionRules& rules) {
  for (auto [name, heads] : {std::pair<const char*, int64_t>{"q_heads", q_heads},
                             std::pair<const char*, int64_t>{"kv_heads", kv_heads}}) {
    TORCH_CHECK_VALUE(heads >= 0, "DistributedAttention: ", name,
                      " must be >= 1, or 0 (None in Python) to take it from the first call; got ",
                      heads);
  }
  rules.check();
}

void check_ring_kernel(const c10::optional<LocalKernel>& kernel) {
  const bool callable = !kernel;
  TORCH_CHECK_VALUE(kernel == LocalKernel::kAuto || kernel == LocalKernel::kFused,
                    "DistributedAttention: hybrid Ulysses x ring attention runs the fused "
                    "kernel; give local=\"auto\" or \"fused\"",
                    callable ? " (not a callable)" : ", not \"" + to_string(*kernel) + "\"");
}

DistributedAttention::DistributedAttention(Group group, AttentionOptions options)
    : group_(std::move(group)), options_(std::move(options)) {
  check_attention_options(options_.q_heads, options_.kv_heads, options_.rules());
  TORCH_CHECK_VALUE(options_.head_chunks >= 1,
                    "DistributedAttention: head_chunks must be >= 1; got ", options_.head_chunks);
  if (options_.q_heads > 0 && options_.kv_heads > 0) {
    partition_ = HeadPartition::make(options_.q_heads, options_.kv_heads, group_.size());
    head_chunks(options_.q_heads, options_.kv_heads, group_.size(), options_.head_chunks);
  }
}

DistributedAttention::DistributedAttention(Group ulysses, Group ring, AttentionOptions options)
    : DistributedAttention(std::move(ulysses), std::move(options)) {
  ring_ = std::move(ring);
}

namespace {

// A module's call: its options and head counts, with this call's inputs.
AttentionCall call_of(const DistributedAttention& module, const AttentionInputs& in) {
  const AttentionOptions& options = module.options();
  const c10::optional<HeadPartition>& partition = module.partition();
  AttentionCall c(module.group());
  c.ring = module.ring();
  c.q_heads = partition ? partition->q_heads() : options.q_heads;
  c.kv_heads = partition ? partition->kv_heads() : options.kv_heads;
  c.seq = in.seq;
  c.layout = options.layout;
  c.rules() = options.rules();
  c.sinks = in.sinks;
  c.exchange = options.exchange;
  c.kernel = options.kernel;
  c.local = options.local ? &options.local : nullptr;
  c.step = in.context;
  return c;
}

// The one gradient the head slices of an input add their parts into (heads_of), handed back
// with the last slice's backward: k chunks make one input-sized gradient, where narrow's
// backward would make a zero-filled input-sized tensor per chunk.
struct GradientBuffer {
  std::vector<int64_t> shape;
  at::TensorOptions options;
  int64_t left = 0;  // Slices whose backward has not run yet.
  at::Tensor grad;
};

// Heads `r` of `x` along `dim`; with `buffer`, differentiable into it (else a plain narrow).
at::Tensor heads_of(const at::Tensor& x, int64_t dim, Range r,
                    const std::shared_ptr<GradientBuffer>& buffer) {
  if (!buffer) return x.narrow(dim, r.begin, r.size());
  std::vector<at::Tensor> out{
      detail::below_autograd([&] { return x.narrow(dim, r.begin, r.size()); })};
  detail::attach_backward(
      {x}, out, "HeadsOfBackward", [dim, r, buffer](std::vector<at::Tensor>&& g) {
        GradientBuffer& b = *buffer;
        if (!b.grad.defined()) b.grad = at::zeros(b.shape, b.options);
        b.grad.narrow(dim, r.begin, r.size()).add_(g[0]);  // (k and v may be one tensor)
        if (--b.left > 0) return std::vector<at::Tensor>{at::Tensor()};
        std::vector<at::Tensor> whole{std::move(b.grad)};
        b.grad = at::Tensor();
        return whole;
      });
  return out[0];
}

// A recomputed chunk's forward results that its backward reads (Note [Recomputed chunks]):
// its heads of the call's o (a detached slice, set once every chunk has landed, with o's
// version then) and, where the fused kernel ran, its row log-sum-exp by heads. Held by the
// chunk's backward function, so freed with it (FunctionNode::release_variables).
struct ChunkResult {
  at::Tensor o, lse;
  uint32_t o_version = 0;
};

// Whether the library runs a call's local attention on the fused kernel (the kernel rule's
// choice for these arguments; not a ring, not the caller's callable).
bool runs_fused_kernel(const AttentionCall& call, const AttentionHeads& h) {
  return !h.ring && !call.local && call.local_by == LocalBy::kLibrary &&
         h.args.q.scalar_type() != at::kDouble &&
         kernel_run_by_cpp(choose_local_kernel(h.args, call.kernel), KernelCase::of(h.args)) ==
             LocalKernel::kFused;
}

// A chunk's call on `x` (q, k, v, the mask and the sinks; undefined: none): with x's sinks.
AttentionCall call_on(const AttentionCall& c, const std::vector<at::Tensor>& x) {
  AttentionCall with = c;
  if (x[4].defined()) with.sinks = x[4];
  return with;
}
c10::optional<at::Tensor> mask_of(const std::vector<at::Tensor>& x) {
  return x[3].defined() ? c10::make_optional(x[3]) : c10::nullopt;
}

// A recomputed chunk's forward (Note [Recomputed chunks]) in its three steps, without autograd,
// apart so that the next chunk's exchange can run between them (Note [Overlapped chunks]): the
// exchange to heads (exchange_chunk), the kernel (chunk_kernel), the exchange back (gather_chunk).
struct ChunkForward {
  AttentionCall call;    // The chunk's, with its sinks.
  AttentionHeads heads;  // Its inputs by heads (args emptied once the kernel has read them).
};

ChunkForward exchange_chunk(const AttentionCall& c, const std::vector<at::Tensor>& inputs,
                            const c10::optional<at::Tensor>& positions) {
  at::NoGradGuard no_grad;
  AttentionCall with = call_on(c, inputs);
  AttentionHeads h = attend_heads(with, {{inputs[0]}, {inputs[1]}, {inputs[2]}}, HeadForm::kWhole,
                                  mask_of(inputs), positions);
  return {std::move(with), std::move(h)};
}

// The chunk's local attention by heads (BHSD); on the fused kernel, its row log-sum-exp goes to
// `result` (backward then reads the chunk's o instead of running the kernel's forward again).
at::Tensor chunk_kernel(const ChunkForward& f, ChunkResult& result) {
  at::NoGradGuard no_grad;
  if (!runs_fused_kernel(f.call, f.heads)) return attention_by_heads(f.call, f.heads);
  at::Tensor o;
  std::tie(o, result.lse) = detail::call_flash_attention(f.heads.args, FlashOptions{});
  return o;
}

at::Tensor gather_chunk(const ChunkForward& f, const at::Tensor& o) {
  at::NoGradGuard no_grad;
  return gather_heads(o.permute(from_bhsd(f.call.layout)), Heads::kQuery, f.heads.sharding,
                      f.call.group);
}

// Whether this rank runs its chunks' kernels on another thread while the next chunk's exchange
// runs on this one (Note [Overlapped chunks]); `wanted`: ULYSSES_OVERLAP_CHUNKS's word.
bool overlaps_kernels(const ChunkForward& f, std::optional<bool> wanted) {
  const at::Tensor& q = f.heads.args.q;
  if (f.heads.ring || f.call.local || f.call.local_by != LocalBy::kLibrary ||
      !q.device().is_cpu() || c10::impl::dispatch_mode_enabled() ||
      q.key_set().has(c10::DispatchKey::Python)) {
    return false;  // (A callable may run collectives, and Python needs the GIL.)
  }
  return wanted ? *wanted : cpu_exchanges_wait_on_links(f.call.group);
}

// Note [Recomputed chunks] (partition.h): `out` is the chunk's call (`c` on `inputs`: q, k, v,
// the mask and the sinks, undefined: none) run without autograd; its backward runs the call's
// first half again with autograd (agreement, exchange, mask) and backpropagates through that.
// Where the fused kernel ran (`result` holds its log-sum-exp), backward does not run the
// kernel's forward again: delta = rowsum(do * o) of the chunk's heads of o (the call's output,
// which the next layer keeps anyway) goes to heads in one exchange with o's gradient, and the
// kernel's backward takes it with the saved log-sum-exp, as after an unchunked forward: the
// same gradients, bit for bit. Elsewhere (SDPA, math, a callable, a ring) the whole call runs
// again (`run`) and backward goes through it. The node keeps the inputs (detached: they are
// views of the caller's tensors). `sources` are the caller's tensors the inputs are slices of
// (the slices, cut below autograd, keep no version of their own): one changed in place since
// forward is refused, as autograd refuses a saved tensor changed so, on every rank of the group
// alike (the others are in the recomputation's agreement by then).
at::Tensor recomputed(const AttentionCall& c, const c10::optional<at::Tensor>& positions,
                      std::function<at::Tensor(const std::vector<at::Tensor>&)> run,
                      const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& sources,
                      const std::shared_ptr<ChunkResult>& result, const at::Tensor& out) {
  std::vector<at::Tensor> outs{out};
  const bool from_output = result->lse.defined();
  std::vector<at::Tensor> differentiable, kept, watched;
  std::vector<bool> learns;
  std::vector<uint32_t> versions;
  for (const at::Tensor& t : inputs) {
    learns.push_back(t.defined() && t.requires_grad());
    if (learns.back()) differentiable.push_back(t);
    kept.push_back(t.defined() ? t.detach() : t);
  }
  for (const at::Tensor& t : sources) {
    if (!t.defined()) continue;
    watched.push_back(t.detach());  // (detach shares the version counter)
    versions.push_back(t._version());
  }
  detail::attach_backward(
      differentiable, outs, "RecomputedChunkBackward",
      [c, positions, from_output, result, run = std::move(run), kept = std::move(kept), learns,
       watched = std::move(watched), versions = std::move(versions),
       group = c.group](std::vector<at::Tensor>&& g) {
        fail_attention_together_on_error(group, [&] {
          for (size_t i = 0; i < watched.size(); ++i) {
            TORCH_CHECK(watched[i]._version() == versions[i],
                        "DistributedAttention (recompute_chunks): an input of the attention was "
                        "modified in place after its forward; backward recomputes the chunks "
                        "from the inputs, so keep them unchanged until backward has run");
          }
          TORCH_CHECK(!from_output || result->o._version() == result->o_version,
                      "DistributedAttention (recompute_chunks): the attention's output was "
                      "modified in place after its forward; backward reads it, so keep it "
                      "unchanged until backward has run");
        });
        std::vector<at::Tensor> again, leaves;
        for (size_t i = 0; i < kept.size(); ++i) {
          again.push_back(learns[i] ? kept[i].detach().requires_grad_() : kept[i]);
          if (learns[i]) leaves.push_back(again.back());
        }
        std::vector<at::Tensor> ends, grads;
        if (from_output) {
          const AttentionCall with = call_on(c, again);
          const AttentionHeads h = [&] {
            at::AutoGradMode with_grad(true);
            return attend_heads(with, {{again[0]}, {again[1]}, {again[2]}}, HeadForm::kWhole,
                                mask_of(again), positions);
          }();
          at::NoGradGuard no_grad;
          const bool mask_grad = h.args.mask && h.args.mask->requires_grad();
          const bool sink_grad = detail::learns_sinks(h.args.sinks);
          std::vector<at::Tensor> d;
          {
            // The kernel's backward reads o only as delta = rowsum(do * o), one fp32 value per
            // head and row: made here by sequence, it goes to heads with o's gradient in one
            // exchange (as two 16-bit halves beside a 16-bit gradient), and o's heads never move.
            // (The kernel reads BHSD views of the exchange's outputs: no copies.)
            const std::vector<int64_t> perm = to_bhsd(with.layout);
            const at::ScalarType dtype = g[0].scalar_type();
            at::Tensor delta = detail::attention_delta(g[0], result->o).unsqueeze(-1);
            if (dtype != at::kFloat) delta = delta.view(dtype);
            const std::vector<at::Tensor> moved = scatter_heads(
                {delta, g[0]}, {Heads::kQuery, Heads::kQuery}, h.sharding, with.group);
            delta = moved[0].view(at::kFloat).permute(perm).squeeze(-1);
            const at::Tensor grad_o = moved[1].permute(perm);
            LocalAttentionArgs a = h.args;  // The kernel's inputs, without their graph.
            a.q = a.q.detach(), a.k = a.k.detach(), a.v = a.v.detach();
            if (a.mask) a.mask = a.mask->detach();
            d = detail::flash_backward_from_delta(grad_o, a, delta, result->lse, mask_grad);
            if (sink_grad) {
              d.push_back(detail::sinks_grad(delta, result->lse, h.args.sinks->detach()));
            }
          }
          // Only the graph of q, k and v by heads is wanted from here: their bytes go before
          // the gradients' exchange back (the kernel's were its only reads).
          const std::vector<at::Tensor> by_heads{h.args.q, h.args.k, h.args.v};
          for (size_t i = 0; i < by_heads.size(); ++i) {
            if (!by_heads[i].requires_grad()) continue;
            ends.push_back(by_heads[i]), grads.push_back(d[i]);
            detail::free_if_unshared(by_heads[i]);
          }
          if (mask_grad) ends.push_back(*h.args.mask), grads.push_back(d[3]);
          if (sink_grad) ends.push_back(*h.args.sinks), grads.push_back(d.back());
        } else {
          at::AutoGradMode with_grad(true);
          at::Tensor o = run(again);
          detail::free_if_unshared(o);  // Its graph is all backward reads.
          ends = {o}, grads = {g[0]};
        }
        return torch::autograd::grad(ends, leaves, grads, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
      });
  return outs[0];
}

}  // namespace

// Note [Head chunks] (partition.h): each chunk is a call of its own on the chunk's heads (a
// per-head mask and the sinks keep the chunk's rows). Each chunk's output is copied into o as it
// comes and freed (a concatenation would hold every chunk's output and o at once), its graph
// kept by its gradient edge; o's backward hands each chunk its heads of o's gradient (views).
// In backward each input's gradient is one buffer the chunks add into (heads_of). So one
// chunk's exchange buffers, whole-sequence tensors and gradients by heads exist at a time beyond
// what the call keeps.
at::Tensor attend_in_head_chunks(AttentionCall call, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const AttentionInputs& in, int64_t count,
                                 bool recompute) {
  const int64_t hq = call.q_heads, dim = head_dim(call.layout);
  std::optional<bool> overlap_wanted;  // ULYSSES_OVERLAP_CHUNKS's word (a bad one fails all).
  const std::vector<HeadChunk> chunks = fail_attention_together_on_error(call.group, [&] {
    if (recompute) overlap_wanted = overlap_chunks_from_environment();
    return head_chunks(hq, call.kv_heads, call.group.size(), count);
  });
  const bool per_head_mask = in.mask && in.mask->dim() == 4 && in.mask->size(1) == hq && hq > 1;
  // One gradient buffer per input that needs one (k and v may be one tensor: two slices a chunk).
  const bool grads = at::GradMode::is_enabled();
  std::vector<std::pair<at::Tensor, std::shared_ptr<GradientBuffer>>> buffers;
  auto buffer_of = [&](const at::Tensor& t) -> std::shared_ptr<GradientBuffer> {
    if (!grads || !t.requires_grad()) return nullptr;
    for (auto& [held, b] : buffers)
      if (held.is_same(t)) return b;
    auto b = std::make_shared<GradientBuffer>();
    b->shape = t.sizes().vec();
    b->options = t.options();
    for (const at::Tensor* u : {&q, &k, &v}) b->left += u->is_same(t) ? 1 : 0;
    b->left *= static_cast<int64_t>(chunks.size());
    buffers.emplace_back(t, b);
    return b;
  };
  const auto q_buffer = buffer_of(q), k_buffer = buffer_of(k), v_buffer = buffer_of(v);
  recompute = recompute && grads;
  std::shared_ptr<const LocalAttention> local;  // Backward's recomputation outlives the module.
  if (recompute) {
    if (call.local) local = std::make_shared<const LocalAttention>(*call.local);
    call.local = local.get();
    call.step = nullptr;  // A step's shared masks would carry forward's graph (none) into backward.
  }
  const std::vector<at::Tensor> sources{q, k, v, in.mask.value_or(at::Tensor()),
                                        call.sinks.value_or(at::Tensor())};
  // A chunk's call, and its inputs: q, k, v, the mask and the sinks (undefined: none), with
  // `graph` differentiable into the gradient buffers, else plain slices (no autograd).
  auto call_for = [&](const HeadChunk& chunk) {
    AttentionCall c = call;
    c.q_heads = chunk.q.size();
    c.kv_heads = chunk.kv.size();
    c.sinks.reset();
    return c;
  };
  auto inputs_of = [&](const HeadChunk& chunk, bool graph) {
    c10::optional<at::NoGradGuard> plain;
    if (!graph) plain.emplace();
    auto into = [&](const std::shared_ptr<GradientBuffer>& b) { return graph ? b : nullptr; };
    c10::optional<at::Tensor> mask = in.mask;
    if (per_head_mask) mask = mask->narrow(1, chunk.q.begin, chunk.q.size());
    return std::vector<at::Tensor>{
        heads_of(q, dim, chunk.q, into(q_buffer)), heads_of(k, dim, chunk.kv, into(k_buffer)),
        heads_of(v, dim, chunk.kv, into(v_buffer)), mask.value_or(at::Tensor()),
        call.sinks ? call.sinks->narrow(0, chunk.q.begin, chunk.q.size()) : at::Tensor()};
  };
  std::vector<std::shared_ptr<ChunkResult>> results;  // Each recomputed chunk's.
  c10::optional<ChunkForward> next;  // Recomputed: the next chunk's, exchanged to heads.
  bool overlap = false;              // Note [Overlapped chunks].
  at::Tensor o;
  std::vector<torch::autograd::Edge> edges;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const HeadChunk& chunk = chunks[i];
    const AttentionCall c = call_for(chunk);
    auto run = [c, positions = in.positions, local](const std::vector<at::Tensor>& x) {
      return attend(call_on(c, x), {{x[0]}, {x[1]}, {x[2]}}, HeadForm::kWhole, mask_of(x),
                    positions)[0];
    };
    at::Tensor part;
    if (!recompute) {
      part = run(inputs_of(chunk, true));
    } else {
      results.push_back(std::make_shared<ChunkResult>());
      ChunkResult& result = *results.back();
      // Chunk i + 1's exchange to heads runs before chunk i's exchange back, overlapped or not.
      const bool last = i + 1 == chunks.size();
      auto exchange_next = [&] {
        if (!last)
          next = exchange_chunk(call_for(chunks[i + 1]), inputs_of(chunks[i + 1], false),
                                in.positions);
      };
      ChunkForward now =
          next ? std::move(*next) : exchange_chunk(c, inputs_of(chunk, false), in.positions);
      next.reset();
      if (i == 0) overlap = !last && overlaps_kernels(now, overlap_wanted);
      at::Tensor by_heads;
      if (overlap && !last) {
        // The kernel on another thread, with this one's thread-local state (grad mode, dispatch
        // keys) and intra-op threads; the future's destructor waits for it if the exchange throws.
        const at::ThreadLocalState state;
        auto kernel = std::async(std::launch::async, [&now, &result, state] {
          at::ThreadLocalStateGuard guard(state);
          at::init_num_threads();
          return chunk_kernel(now, result);
        });
        exchange_next();
        by_heads = kernel.get();
        c.group.recorder().overlapped_kernel();
      } else {
        by_heads = chunk_kernel(now, result);
      }
      now.heads.args = LocalAttentionArgs{};  // q, k and v by heads: read.
      if (!overlap) exchange_next();
      part = recomputed(c, in.positions, run, inputs_of(chunk, true), sources, results.back(),
                        gather_chunk(now, by_heads));
    }
    if (!o.defined()) {
      std::vector<int64_t> shape = part.sizes().vec();
      shape[dim] = hq;
      o = at::empty(shape, part.options());
    }
    {
      at::NoGradGuard no_grad;
      o.narrow(dim, chunk.q.begin, chunk.q.size()).copy_(part);
    }
    if (part.requires_grad()) edges.push_back(torch::autograd::impl::gradient_edge(part));
  }
  for (size_t i = 0; i < results.size(); ++i) {  // Backward reads its heads of o (all landed).
    results[i]->o = o.detach().narrow(dim, chunks[i].q.begin, chunks[i].q.size());
    results[i]->o_version = o._version();
  }
  if (!edges.empty()) {
    TORCH_INTERNAL_ASSERT(edges.size() == chunks.size());
    std::vector<Range> heads;
    for (const HeadChunk& chunk : chunks) heads.push_back(chunk.q);
    auto node = detail::make_node<detail::FunctionNode>(
        "PutHeadsBackward", [dim, heads](std::vector<at::Tensor>&& g) {
          std::vector<at::Tensor> parts;
          for (const Range& r : heads) parts.push_back(g[0].narrow(dim, r.begin, r.size()));
          return parts;
        });
    node->set_next_edges(std::move(edges));
    node->record_output(o);
    torch::autograd::set_history(o, node);
  }
  return o;
}

at::Tensor DistributedAttention::forward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const AttentionInputs& in) {
  AttentionCall c = call_of(*this, in);
  // Head counts not in the options are this instance's from the first call on (every rank's
  // are checked in the call's agreement).
  if (c.q_heads == 0) c.q_heads = heads_of(q, options_.layout);
  if (c.kv_heads == 0) c.kv_heads = heads_of(k, options_.layout);
  at::Tensor o =
      options_.head_chunks > 1 || options_.recompute_chunks
          ? attend_in_head_chunks(c, q, k, v, in, options_.head_chunks, options_.recompute_chunks)
          : attend(c, {{q}, {k}, {v}}, HeadForm::kWhole, in.mask, in.positions)[0];
  if (!partition_) partition_ = HeadPartition::make(c.q_heads, c.kv_heads, group_.size());
  return o;
}

std::vector<at::Tensor> DistributedAttention::forward_parts(const std::vector<at::Tensor>& q,
                                                            const std::vector<at::Tensor>& k,
                                                            const std::vector<at::Tensor>& v,
                                                            const AttentionInputs& in) {
  if (!partition_) {
    fail_attention_together(
        group_,
        std::make_exception_ptr(c10::ValueError(
            {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
            "DistributedAttention::forward_parts: give q_heads and kv_heads in the options (parts "
            "do not show the totals)")));
  }
  return attend(call_of(*this, in), {q, k, v}, HeadForm::kParts, in.mask, in.positions);
}

}  // namespace ulysses
