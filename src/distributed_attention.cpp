#include "ulysses/distributed_attention.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>

#include "ulysses/attention.h"
#include "ulysses/flash_attention.h"
#include "ulysses/mask.h"

namespace ulysses {
namespace {

// `mask` (bool or additive, or none) further restricted to the `allowed` positions.
at::Tensor restrict_mask(const c10::optional<at::Tensor>& mask, const at::Tensor& allowed) {
  if (!mask) return allowed;
  if (mask->scalar_type() == at::kBool) return mask->logical_and(allowed);
  return mask->masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
}

// Note [Local attention by device]: CPU tensors use our fused kernel. CUDA tensors use
// at::scaled_dot_product_attention (kv heads expanded through the kv map, packed documents
// folded into the mask), which picks the flash or memory-efficient backend.
at::Tensor sdpa_attention(const LocalAttentionArgs& a) {
  at::Tensor map = at::tensor(a.kv_map, a.q.options().dtype(at::kLong));
  at::Tensor k = a.k.index_select(1, map), v = a.v.index_select(1, map);
  const at::Tensor& q = a.q;
  const c10::optional<double> scale =
      a.scale > 0 ? c10::optional<double>(a.scale) : c10::optional<double>();
  // SDPA takes a mask or is_causal, not both: the rules become a mask unless causal is alone.
  if (!a.mask && !a.positions && !a.rows) {
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, a.causal, scale);
  }
  c10::optional<at::Tensor> mask = a.mask;
  if (auto rule = structure_mask(a)) mask = restrict_mask(mask, *rule);
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale);
}

}  // namespace

LocalAttention default_local_attention() {
  return [](const LocalAttentionArgs& args) {
    return args.q.is_cpu() ? flash_attention(args) : sdpa_attention(args);
  };
}

at::Tensor StepContext::lookup(std::vector<Entry>& entries, const at::Tensor& source,
                               const std::vector<Range>& q_ranges, const SequencePartition& seq,
                               int64_t keys, const std::function<at::Tensor()>& build) {
  for (const Entry& e : entries) {
    if (e.source.is_same(source) && e.version == source._version() && e.q_ranges == q_ranges &&
        e.seq_lengths == seq.lengths() && e.keys == keys) {
      ++reuses_;
      return e.result;
    }
  }
  Entry e{source, static_cast<int64_t>(source._version()), q_ranges, seq.lengths(), keys, build()};
  entries.push_back(e);
  return e.result;
}

at::Tensor StepContext::rebuilt_mask(const at::Tensor& mask, const AllToAllPlan& plan,
                                     const RingLayout* layout, int64_t sp_rank) {
  // A head-shared mask does not depend on the head split: one entry serves every instance.
  const bool shared = mask.dim() < 3 || (mask.dim() == 3 ? mask.size(0) : mask.size(1)) == 1;
  const std::vector<Range> key = shared ? std::vector<Range>{} : plan.heads.q_ranges();
  if (layout) {
    // Which rows a ring rank's mask holds depends on its SP rank: part of the key.
    std::vector<Range> ring_key = key;
    ring_key.push_back({sp_rank, sp_rank});
    return lookup(masks_, mask, ring_key, plan.seq, layout->seq_len(),
                  [&] { return rebuild_ring_mask(mask, plan, *layout, sp_rank, group_); });
  }
  return lookup(masks_, mask, key, plan.seq, -1, [&] { return rebuild_mask(mask, plan, group_); });
}

at::Tensor StepContext::gathered_positions(const at::Tensor& positions,
                                           const SequencePartition& seq) {
  return lookup(positions_, positions, {}, seq, -1,
                [&] { return all_gather_sequence(positions, -1, seq, group_); });
}

at::Tensor StepContext::ring_documents(const at::Tensor& positions, const RingLayout& layout,
                                       const Group& ring) {
  return lookup(documents_, positions, {}, SequencePartition::from_lengths(layout.ring_lengths()),
                layout.seq_len(), [&] { return ring_document_ids(positions, layout, ring); });
}

DistributedAttention::DistributedAttention(Group group, AttentionOptions options)
    : group_(std::move(group)), options_(std::move(options)) {
  TORCH_CHECK_VALUE(options_.q_heads >= 0 && options_.kv_heads >= 0,
                    "DistributedAttention: q_heads and kv_heads must be >= 0 (0: taken from the "
                    "first call); got q_heads=",
                    options_.q_heads, ", kv_heads=", options_.kv_heads);
  if (!options_.local) options_.local = default_local_attention();
  if (options_.q_heads > 0 && options_.kv_heads > 0) {
    partition_ = HeadPartition::make(options_.q_heads, options_.kv_heads, group_.size());
  }
}

DistributedAttention::DistributedAttention(Group ulysses, Group ring, AttentionOptions options)
    : DistributedAttention(std::move(ulysses), std::move(options)) {
  ring_ = std::move(ring);
}

RingLayout DistributedAttention::agree_ring(const AllToAllPlan& plan, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v,
                                            const AttentionInputs& in) const {
  // Every ring rank must run the same ring: agree on the call, and learn each ring rank's
  // token count (the zigzag layout fixes them once S is known). Before any data moves.
  const std::vector<std::vector<int64_t>> meta = ring_.agree([&] {
    std::vector<int64_t> m{plan.seq.seq_len()};
    for (const at::Tensor* t : {&q, &k, &v}) {
      std::vector<int64_t> shape = t->sizes().vec();
      shape[seq_dim(options_.layout)] = 0;
      m.insert(m.end(), shape.begin(), shape.end());
    }
    m.push_back(static_cast<int64_t>(q.scalar_type()));
    m.push_back(in.positions ? in.positions->dim() : -1);
    m.push_back(options_.causal ? 1 : 0);
    const auto mask_sizes = in.mask ? mask_sizes_4d(in.mask->sizes().vec(), "mask")
                                    : std::array<int64_t, 4>{-1, -1, -1, -1};
    m.insert(m.end(), mask_sizes.begin(), mask_sizes.end());
    return m;
  });
  int64_t S = 0;
  for (const auto& m : meta) S += m[0];
  const RingLayout layout = RingLayout::make(S, group_.size(), ring_.size());
  const size_t n = meta[0].size();  // Mask sizes last: [Bm, Hm, Sq, Sk].
  for (int r = 0; r < ring_.size(); ++r) {
    const int64_t rows = meta[r][n - 2], keys = meta[r][n - 1];
    const int64_t shard = layout.shard_index(r * group_.size() + group_.rank()).numel();
    TORCH_CHECK_VALUE(
        rows == -1 || ((rows == shard || rows == S || rows == 1) && (keys == S || keys == 1)),
        "DistributedAttention: with a ring, a mask's query rows must be this rank's ", shard,
        " tokens, all ", S, " or 1, and its keys all ", S, " (in global order) or 1; ring rank ", r,
        "'s mask is [", meta[r][n - 4], ", ", meta[r][n - 3], ", ", rows, ", ", keys, "]");
    TORCH_CHECK_VALUE(std::equal(meta[r].begin() + 1, meta[r].end() - 2, meta[0].begin() + 1),
                      "DistributedAttention: ring ranks 0 and ", r,
                      " disagree on the call (shapes of q, k, v, dtype, position ids, mask or "
                      "causal)");
    TORCH_CHECK_VALUE(meta[r][0] == layout.ring_length(r), "DistributedAttention: ring rank ", r,
                      "'s Ulysses group holds ", meta[r][0], " tokens; the zigzag layout of ", S,
                      " tokens gives it ", layout.ring_length(r),
                      " (shard inputs with RingLayout::shard / ulysses.shard_sequence)");
  }
  return layout;
}

at::Tensor DistributedAttention::forward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const AttentionInputs& in) {
  return attend(q, k, v, nullptr, in)[0];
}

std::vector<at::Tensor> DistributedAttention::forward_parts(const std::vector<at::Tensor>& q,
                                                            const std::vector<at::Tensor>& k,
                                                            const std::vector<at::Tensor>& v,
                                                            const AttentionInputs& in) {
  at::Tensor qs, ks, vs;
  try {
    TORCH_CHECK_VALUE(partition_, "DistributedAttention::forward_parts: give q_heads and kv_heads ",
                      "in the options (parts do not show the totals)");
    const std::string who = "DistributedAttention::forward_parts: ";
    qs = stand_in_for_parts(q, Heads::kQuery, *partition_, options_.layout, who + "q");
    ks = stand_in_for_parts(k, Heads::kKeyValue, *partition_, options_.layout, who + "k");
    vs = stand_in_for_parts(v, Heads::kKeyValue, *partition_, options_.layout, who + "v");
  } catch (const std::exception&) {
    group_.fail_together(std::current_exception());
  }
  const std::vector<std::vector<at::Tensor>> parts{q, k, v};
  return attend(qs, ks, vs, &parts, in);
}

std::vector<at::Tensor> DistributedAttention::attend(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::vector<std::vector<at::Tensor>>* parts, const AttentionInputs& in) {
  const Layout L = options_.layout;
  const int64_t hdim = head_dim(L);
  TORCH_CHECK_VALUE(in.context == nullptr || in.context->group().size() == group_.size(),
                    "DistributedAttention: the StepContext's group has ",
                    in.context ? in.context->group().size() : 0, " ranks but this attention's has ",
                    group_.size());
  if (!partition_) {
    // Head counts not given in the options are captured on this instance from the first
    // call's q and k. Each rank reads its own tensors, so ranks agree on the outcome first: an
    // invalid count on one rank raises the same error on every rank.
    group_.agree([&] {
      TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4, "DistributedAttention: q and k must be 4-D (",
                        to_string(L), "); got ", q.sizes(), " and ", k.sizes());
      const int64_t hq = options_.q_heads > 0 ? options_.q_heads : q.size(hdim);
      const int64_t hkv = options_.kv_heads > 0 ? options_.kv_heads : k.size(hdim);
      partition_ = HeadPartition::make(hq, hkv, group_.size());
      return std::vector<int64_t>{};
    });
  }
  const HeadPartition& heads = *partition_;
  // Everything that decides which collectives follow, and their sizes, agreed in the same round
  // as the plan: a rank that differs fails together with the others instead of hanging them.
  auto kind = [&](const c10::optional<at::Tensor>& t) -> std::vector<int64_t> {
    if (!t) return {0, -1, -1, 0, 1};
    return {1, t->dim(), static_cast<int64_t>(t->scalar_type()), t->requires_grad() ? 1 : 0,
            t->device() == q.device() ? 1 : 0};
  };
  const auto m = kind(in.mask), p = kind(in.positions);
  const AllToAllPlan plan = agree_plan(
      group_, heads, L,
      {{q, Heads::kQuery, "q"}, {k, Heads::kKeyValue, "k"}, {v, Heads::kKeyValue, "v"}}, in.seq,
      {{"whether a mask is given", m[0]},
       {"the mask's number of dims", m[1]},
       {"the mask's dtype (as c10::ScalarType)", m[2]},
       {"whether the mask requires grad", m[3]},
       {"whether the mask is on q's device", m[4]},
       {"whether position ids are given", p[0]},
       {"the position ids' number of dims", p[1]},
       {"the position ids' dtype (as c10::ScalarType)", p[2]},
       {"whether the position ids are on q's device", p[4]},
       {"whether q, k or v require grad",
        q.requires_grad() || k.requires_grad() || v.requires_grad() ? 1 : 0},
       {"causal", options_.causal ? 1 : 0},
       {"whether a StepContext is used", in.context ? 1 : 0}});
  c10::optional<RingLayout> ring_layout;
  if (ring_.size() > 1) {
    // A ring group that refuses the call fails its Ulysses groups too (and through them every
    // rank of the SP group), with the same text: no rank is left waiting in an all-to-all.
    std::exception_ptr refused;
    try {
      ring_layout = agree_ring(plan, q, k, v, in);
    } catch (const std::exception&) {
      refused = std::current_exception();
    }
    group_.agree([&] {
      if (refused) std::rethrow_exception(refused);
      return std::vector<int64_t>{};
    });
  }
  const std::vector<Heads> kinds{Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue};
  std::vector<at::Tensor> qkv;
  if (parts && options_.fuse_qkv) {
    qkv = scatter_head_parts(*parts, kinds, plan, group_);
  } else if (parts) {
    for (size_t i = 0; i < 3; ++i)
      qkv.push_back(scatter_head_parts((*parts)[i], kinds[i], plan, group_));
  } else if (options_.fuse_qkv) {
    qkv = scatter_heads({q, k, v}, kinds, plan, group_);
  } else {
    for (size_t i = 0; i < 3; ++i)
      qkv.push_back(scatter_heads(std::vector<at::Tensor>{q, k, v}[i], kinds[i], plan, group_));
  }
  LocalAttentionArgs args;
  const auto perm = to_bhsd(L);
  args.q = qkv[0].permute(perm);
  args.k = qkv[1].permute(perm);
  args.v = qkv[2].permute(perm);
  args.kv_map = heads.kv_map(group_.rank());
  args.causal = options_.causal;
  args.scale = options_.scale;
  if (in.mask && ring_layout) {  // Rows of this ring rank's queries, every key in global order.
    const int64_t sp_rank = ring_.rank() * group_.size() + group_.rank();
    args.mask = in.context ? in.context->rebuilt_mask(*in.mask, plan, &*ring_layout, sp_rank)
                           : rebuild_ring_mask(*in.mask, plan, *ring_layout, sp_rank, group_);
  } else if (in.mask) {
    args.mask = in.context ? in.context->rebuilt_mask(*in.mask, plan)
                           : rebuild_mask(*in.mask, plan, group_);
  }
  if (in.positions) {
    args.positions = in.context ? in.context->gathered_positions(*in.positions, plan.seq)
                                : all_gather_sequence(*in.positions, -1, plan.seq, group_);
  }
  at::Tensor o;
  if (ring_layout) {
    at::Tensor docs;
    if (args.positions) {
      docs = in.context ? in.context->ring_documents(*args.positions, *ring_layout, ring_)
                        : ring_document_ids(*args.positions, *ring_layout, ring_);
    }
    args.positions.reset();
    o = ring_attention(args, *ring_layout, docs, ring_);
  } else {
    o = options_.local(args);
  }
  o = o.permute(from_bhsd(L));
  if (parts) return gather_head_parts(o, Heads::kQuery, plan, group_);
  return {gather_heads(o, Heads::kQuery, plan, group_)};
}

}  // namespace ulysses
