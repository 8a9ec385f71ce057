#include "ulysses/ring_attention.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <sstream>

#include "attention/ops.h"
#include "kernels/ops.h"
#include "transport/message_tags.h"
#include "transport/transfers.h"
#include "ulysses/flash_attention.h"
#include "ulysses/mask.h"

namespace ulysses {
namespace {
// For tokens concatenated in ring-rank order (every ring rank's, or every SP rank's, shards in
// rank order: the same thing), the position of each global token.
at::Tensor global_order(const RingLayout& layout) {
  std::vector<at::Tensor> index;
  for (int64_t r = 0; r < layout.ring(); ++r) index.push_back(layout.ring_index(r));
  at::Tensor where = at::empty({layout.seq_len()}, at::kLong);
  where.index_put_({at::cat(index)}, at::arange(layout.seq_len(), at::kLong));
  return where;
}
}  // namespace

RingLayout RingLayout::make(int64_t seq_len, int64_t ulysses, int64_t ring) {
  TORCH_CHECK_VALUE(ulysses >= 1 && ring >= 1,
                    "RingLayout: Ulysses and ring sizes must be >= 1; got ", ulysses, " x ", ring);
  return RingLayout(SequencePartition::even(seq_len, 2 * ring), ulysses, ring);
}

int64_t RingLayout::ring_length(int64_t r) const {
  TORCH_CHECK_INDEX(r >= 0 && r < ring_, "RingLayout: ring rank ", r, " out of range [0, ", ring_,
                    ")");
  return chunks_.length(r) + chunks_.length(2 * ring_ - 1 - r);
}

std::vector<int64_t> RingLayout::ring_lengths() const {
  std::vector<int64_t> lengths;
  for (int64_t r = 0; r < ring_; ++r) lengths.push_back(ring_length(r));
  return lengths;
}

at::Tensor RingLayout::ring_index(int64_t r) const {
  ring_length(r);  // Checks r.
  const Range a = chunks_.range(r), b = chunks_.range(2 * ring_ - 1 - r);
  return at::cat({at::arange(a.begin, a.end, at::kLong), at::arange(b.begin, b.end, at::kLong)});
}

at::Tensor RingLayout::shard_index(int64_t p) const {
  TORCH_CHECK_INDEX(p >= 0 && p < sp_size(), "RingLayout: SP rank ", p, " out of range [0, ",
                    sp_size(), ")");
  const int64_t r = p / ulysses_, u = p % ulysses_;
  const Range mine = SequencePartition::even(ring_length(r), ulysses_).range(u);
  return ring_index(r).slice(0, mine.begin, mine.end);
}

at::Tensor RingLayout::shard(const at::Tensor& full, int64_t dim, int64_t p) const {
  TORCH_CHECK_VALUE(full.size(dim) == seq_len(), "RingLayout::shard: dim ", dim, " of ",
                    full.sizes(), " must hold the ", seq_len(), " tokens of the layout");
  return full.index_select(dim, shard_index(p).to(full.device()));
}

at::Tensor RingLayout::unshard(const std::vector<at::Tensor>& shards, int64_t dim) const {
  TORCH_CHECK_VALUE(static_cast<int64_t>(shards.size()) == sp_size(), "RingLayout::unshard: want ",
                    sp_size(), " shards; got ", shards.size());
  at::Tensor stacked = at::cat(shards, dim);
  return stacked.index_select(dim, global_order(*this).to(stacked.device()));
}

namespace {

// What both passes of one ring attention read; tensors detached.
struct Ring {
  LocalAttentionArgs args;  // This rank's q, k, v and options.
  RingLayout layout = RingLayout::make(0, 1, 1);
  at::Tensor docs;  // [B or 1, S] or undefined.
  Group group = Group::solo();
  int64_t B = 0, Hkv = 0, D = 0, Dv = 0;

  int rank() const { return group.rank(); }
  int next() const { return (group.rank() + 1) % group.size(); }
  int prev() const { return (group.rank() + group.size() - 1) % group.size(); }
  int source(int step) const {
    return (group.rank() - step % group.size() + group.size()) % group.size();
  }

  // A packed [k | v] (or [dk | dv]) block of ring rank `src`, in `dtype`.
  at::Tensor new_block(int src, at::ScalarType dtype) const {
    return group.new_buffer({B * Hkv * layout.ring_length(src) * (D + Dv)},
                            args.q.options().dtype(dtype));
  }
  at::Tensor pack(const at::Tensor& k, const at::Tensor& v, int src, at::ScalarType dtype) const {
    at::Tensor block = new_block(src, dtype);
    const int64_t nk = k.numel();
    block.slice(0, 0, nk).view(k.sizes()).copy_(k);
    block.slice(0, nk).view(v.sizes()).copy_(v);
    return block;
  }
  std::pair<at::Tensor, at::Tensor> unpack(const at::Tensor& block, int src) const {
    const int64_t L = layout.ring_length(src), nk = B * Hkv * L * D;
    return {block.slice(0, 0, nk).view({B, Hkv, L, D}), block.slice(0, nk).view({B, Hkv, L, Dv})};
  }

  // The local attention of our queries over ring rank `src`'s keys. Blocks travel in the
  // inputs' dtype; the kernel computes in fp32 either way, and taking fp32 q, k, v makes it
  // return fp32 partial outputs and gradients, merged and summed without rounding per block.
  LocalAttentionArgs block_args(const at::Tensor& k, const at::Tensor& v, int src) const {
    LocalAttentionArgs a = args;
    a.q = q32;
    a.k = k.to(at::kFloat), a.v = v.to(at::kFloat);
    GlobalRows rows = q_rows;
    rows.k_index = layout.ring_index(src);
    if (docs.defined()) rows.k_docs = docs.index_select(-1, rows.k_index);
    a.rows = rows;
    if (args.mask && keyed_mask()) a.mask = args.mask->index_select(3, rows.k_index);
    return a;
  }
  // The mask has a column per global key (else one column for all).
  bool keyed_mask() const { return args.mask->size(3) == layout.seq_len() && layout.seq_len() > 1; }
  bool mask_grad = false;  // Whether backward returns the mask's gradient.
  at::Tensor q32;          // args.q in fp32.
  GlobalRows q_rows;       // Our queries' global index (and document ids); no keys yet.
};

// Forward: out [B, Hq, Sq, Dv] (fp32) and lse [B, Hq, Sq] (+inf for rows with no key).
std::pair<at::Tensor, at::Tensor> ring_forward(const Ring& ring) {
  const int R = ring.group.size();
  at::Tensor block = ring.pack(ring.args.k, ring.args.v, ring.rank(), ring.args.k.scalar_type());
  at::Tensor out, lse;
  for (int t = 0; t < R; ++t) {
    const int src = ring.source(t);
    std::optional<Transfers> step;
    at::Tensor incoming;
    if (t + 1 < R) {  // The next block moves while this one is computed on.
      incoming = ring.new_block(ring.source(t + 1), block.scalar_type());
      step.emplace(ring.group, block.device().type());
      step->send(block, ring.next(), detail::kRingKeyValues);
      step->receive(incoming, ring.prev(), detail::kRingKeyValues);
      step->post();
    }
    auto [k, v] = ring.unpack(block, src);
    auto [o_t, lse_t] = flash_attention_forward(ring.block_args(k, v, src));
    if (t == 0) {
      out = o_t, lse = lse_t;
    } else {
      std::tie(out, lse) = merge_attention(out, lse, o_t, lse_t);
    }
    if (step) step->wait();
    block = incoming;
  }
  return {out, lse};
}

// Backward: {dq, dk, dv, dmask (if ring.mask_grad)} for grad_out, given delta = rowsum(grad_out
// * out) of the forward's merged out (each block's kernel backward reads it) and lse. Each step's
// transfers go as one batch: the next key/value block, then the gradient accumulator of the
// previous step's block, in that order on every rank (NCCL matches a pair's transfers by order).
std::vector<at::Tensor> ring_backward(const Ring& ring, const at::Tensor& grad_out,
                                      const at::Tensor& delta, const at::Tensor& lse) {
  const int R = ring.group.size();
  const auto& a = ring.args;
  at::Tensor block = ring.pack(a.k, a.v, ring.rank(), a.k.scalar_type());
  at::Tensor dq = at::zeros(a.q.sizes(), a.q.options().dtype(at::kFloat));
  at::Tensor dmask;
  if (ring.mask_grad) dmask = at::zeros(a.mask->sizes(), a.q.options().dtype(at::kFloat));
  at::Tensor grads;  // The accumulator of the previous step's block, sent on at this step.
  for (int t = 0; t < R; ++t) {
    const int src = ring.source(t);
    std::optional<Transfers> step;
    at::Tensor incoming, partial;
    size_t arriving = 0;
    if (R > 1 && (t + 1 < R || t > 0)) step.emplace(ring.group, block.device().type());
    if (t + 1 < R) {
      incoming = ring.new_block(ring.source(t + 1), block.scalar_type());
      step->send(block, ring.next(), detail::kRingKeyValues);
      step->receive(incoming, ring.prev(), detail::kRingKeyValues);
    }
    if (t > 0) {  // Block src's accumulator, from the rank that held src's block before us.
      partial = ring.new_block(src, at::kFloat);
      step->send(grads, ring.next(), detail::kRingGradients);
      arriving = step->receive(partial, ring.prev(), detail::kRingGradients);
    }
    if (step) step->post();
    auto [k, v] = ring.unpack(block, src);
    const LocalAttentionArgs block_args = ring.block_args(k, v, src);
    auto g = detail::flash_backward_from_delta(grad_out, block_args, delta, lse, ring.mask_grad);
    dq.add_(g[0]);
    if (ring.mask_grad) {
      at::Tensor dm = g[3].to(at::kFloat);
      ring.keyed_mask() ? dmask.index_add_(3, block_args.rows->k_index, dm) : dmask.add_(dm);
    }
    at::Tensor mine = ring.pack(g[1], g[2], src, at::kFloat);
    if (t > 0) {
      step->wait(arriving);
      mine.add_(partial);
    }
    if (step) step->wait();
    grads = mine;
    if (t + 1 < R) block = incoming;
  }
  at::Tensor own = grads;
  if (R > 1) {  // Our block's accumulator, after every rank's contribution.
    own = ring.new_block(ring.rank(), at::kFloat);
    Transfers home(ring.group, own.device().type());
    home.send(grads, ring.next(), detail::kRingGradients);
    home.receive(own, ring.prev(), detail::kRingGradients);
    home.wait();
  }
  auto [dk, dv] = ring.unpack(own, ring.rank());
  return {dq.to(a.q.scalar_type()), dk.to(a.k.scalar_type()), dv.to(a.v.scalar_type()),
          ring.mask_grad ? dmask.to(a.mask->scalar_type()) : at::Tensor()};
}

}  // namespace

namespace {

Ring make_ring(const LocalAttentionArgs& args, const RingLayout& layout, const at::Tensor& docs,
               const Group& group, bool mask_grad) {
  TORCH_CHECK_VALUE(!args.positions && !args.rows,
                    "ring_attention: pass packed documents as `docs`; positions and rows are not "
                    "accepted");
  TORCH_CHECK_VALUE(layout.ring() == group.size(), "ring_attention: the layout has ", layout.ring(),
                    " ring ranks but the ring group has ", group.size());
  TORCH_CHECK_VALUE(args.q.dim() == 4 && args.k.dim() == 4 && args.v.dim() == 4,
                    "ring_attention: q, k, v must be 4-D BHSD; got ", args.q.sizes(), ", ",
                    args.k.sizes(), ", ", args.v.sizes());
  const int64_t L = layout.ring_length(group.rank());
  TORCH_CHECK_VALUE(args.q.size(2) == L && args.k.size(2) == L && args.v.size(2) == L,
                    "ring_attention: ring rank ", group.rank(), " holds ", L,
                    " tokens of the layout; got q ", args.q.sizes(), ", k ", args.k.sizes());
  TORCH_CHECK_NOT_IMPLEMENTED(args.q.is_cpu(),
                              "ring_attention: CPU tensors only (the fused CPU kernel returns the "
                              "log-sum-exp the merge needs); got ",
                              args.q.device());
  Ring ring;
  ring.args = args;
  ring.args.q = args.q.detach(), ring.args.k = args.k.detach(), ring.args.v = args.v.detach();
  if (args.mask) {
    const at::Tensor m = as_4d_mask(args.mask->detach());
    TORCH_CHECK_VALUE(
        (m.size(2) == L || m.size(2) == 1) && (m.size(3) == layout.seq_len() || m.size(3) == 1),
        "ring_attention: the mask must be [B or 1, heads or 1, ", L, " or 1, ", layout.seq_len(),
        " or 1] (this ring rank's queries, every key in global "
        "order); got ",
        args.mask->sizes());
    TORCH_CHECK_VALUE(!mask_grad || m.is_floating_point(),
                      "ring_attention: a mask gradient needs a floating-point mask");
    ring.args.mask = m;
  }
  ring.mask_grad = mask_grad;
  ring.q32 = ring.args.q.to(at::kFloat);
  ring.layout = layout;
  if (docs.defined()) {
    ring.docs = (docs.dim() == 1 ? docs.unsqueeze(0) : docs).to(at::kLong);
    TORCH_CHECK_VALUE(ring.docs.dim() == 2 && ring.docs.size(1) == layout.seq_len(),
                      "ring_attention: docs must be [B or 1, ", layout.seq_len(), "]; got ",
                      docs.sizes());
  }
  ring.group = group;
  ring.q_rows.q_index = layout.ring_index(group.rank());
  if (ring.docs.defined()) ring.q_rows.q_docs = ring.docs.index_select(-1, ring.q_rows.q_index);
  ring.B = args.q.size(0), ring.Hkv = args.k.size(1), ring.D = args.k.size(3);
  ring.Dv = args.v.size(3);
  return ring;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ring_attention_forward(const LocalAttentionArgs& args,
                                                          const RingLayout& layout,
                                                          const at::Tensor& docs,
                                                          const Group& group) {
  const Ring ring = make_ring(args, layout, docs, group, false);
  at::NoGradGuard no_grad;
  auto [out, lse] = ring_forward(ring);
  return {out.to(args.q.scalar_type()), lse};
}

std::vector<at::Tensor> ring_attention_backward(const at::Tensor& grad_out,
                                                const LocalAttentionArgs& args,
                                                const RingLayout& layout, const at::Tensor& docs,
                                                const Group& group, const at::Tensor& out,
                                                const at::Tensor& lse, bool mask_grad) {
  at::NoGradGuard no_grad;
  return detail::ring_backward_from_delta(grad_out, args, layout, docs, group,
                                          detail::attention_delta(grad_out, out), lse, mask_grad);
}

std::vector<at::Tensor> detail::ring_backward_from_delta(const at::Tensor& grad_out,
                                                         const LocalAttentionArgs& args,
                                                         const RingLayout& layout,
                                                         const at::Tensor& docs, const Group& group,
                                                         const at::Tensor& delta,
                                                         const at::Tensor& lse, bool mask_grad) {
  const Ring ring = make_ring(args, layout, docs, group, mask_grad);
  at::NoGradGuard no_grad;
  return ring_backward(ring, grad_out.to(at::kFloat).contiguous(), delta.contiguous(), lse);
}

at::Tensor ring_attention(const LocalAttentionArgs& args, const RingLayout& layout,
                          const at::Tensor& docs, const Group& group) {
  return std::get<0>(detail::call_ring_attention(args, layout, docs, group));
}

at::Tensor rebuild_ring_mask(const at::Tensor& mask, const Sharding& sharding,
                             const RingLayout& layout, int64_t sp_rank, const Group& ulysses) {
  at::Tensor m = as_4d_mask(mask);
  const int64_t S = layout.seq_len();
  const at::Tensor mine = layout.shard_index(sp_rank);
  if (m.size(2) == S && mine.numel() != S) m = m.index_select(2, mine.to(m.device()));
  return rebuild_mask(m, sharding, ulysses, S);
}

at::Tensor ring_document_ids(const at::Tensor& positions, const RingLayout& layout,
                             const Group& ring) {
  // Ring ranks' tokens in ring-rank order, then in global order.
  at::Tensor gathered = all_gather_sequence(
      positions, -1, SequencePartition::from_lengths(layout.ring_lengths()), ring);
  at::Tensor docs =
      document_ids(gathered.index_select(-1, global_order(layout).to(gathered.device())));
  return docs.dim() == 1 ? docs.unsqueeze(0) : docs;
}

}  // namespace ulysses
