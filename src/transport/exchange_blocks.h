// Block geometry of an exchange: where each block of an ExchangePlan lies in the tensors one
// side reads or writes (whole tensors, or head parts by peer), and the fresh outputs of the
// receiving side. What the collective, pipelined and shared-memory exchanges share.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "transport/slabs.h"
#include "ulysses/exchange_plan.h"
#include "ulysses/group.h"
#include "ulysses/partition.h"

namespace ulysses {

// `like`'s sizes with the sequence dim set to `seq` and the head dim to `heads`.
inline std::vector<int64_t> shape_with(at::IntArrayRef like, Layout layout, int64_t seq,
                                       int64_t heads) {
  std::vector<int64_t> s = like.vec();
  s[seq_dim(layout)] = seq;
  s[head_dim(layout)] = heads;
  return s;
}

// True when every dim before `dim` has size 1, so slices along `dim` are contiguous blocks.
inline bool leading_dims_trivial(at::IntArrayRef sizes, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i)
    if (sizes[i] != 1) return false;
  return true;
}

// Blocks `blocks` of a tensor of `extent` tile its memory in buffer order, so the flat buffer can
// be the tensor itself: one tensor whose dims before the sequence dim are all 1, and blocks of
// all its heads over consecutive tokens.
inline bool tiles_in_order(const std::vector<ExchangeBlock>& blocks, const Extent& extent,
                           const at::Tensor& x, int64_t sdim) {
  if (!x.is_contiguous() || !leading_dims_trivial(x.sizes(), sdim)) return false;
  int64_t next = 0;
  for (const ExchangeBlock& b : blocks) {
    if (b.tensor != 0 || b.heads != Range{0, extent.heads} || b.tokens.begin != next) return false;
    next = b.tokens.end;
  }
  return next == extent.tokens;
}

// The tensors one side of an exchange reads (or writes), and where each block lies in them:
// whole tensors, one per fused tensor (a block is a view of its tokens x heads), or parts, one
// per peer (the block for peer j is all of parts[j]: its heads were split off beforehand, e.g.
// by a projection per destination).
struct BlockTensors {
  std::vector<at::Tensor> tensors;
  bool by_peer = false;
  Layout layout = Layout::kBSHD;
  int64_t peers = 1;  // Parts are [tensor][peer], flattened: tensors[t * peers + peer].

  // Tokens [first, first + count) of block `b` (counted from its first token), of batch entry
  // `batch` (-1: all).
  at::Tensor view(const ExchangeBlock& b, int64_t batch, int64_t first, int64_t count) const {
    at::Tensor t = tensors[by_peer ? b.tensor * peers + b.peer : b.tensor];
    if (batch >= 0) t = t.narrow(batch_dim(layout), batch, 1);
    t = t.narrow(seq_dim(layout), (by_peer ? 0 : b.tokens.begin) + first, count);
    return by_peer ? t : t.narrow(head_dim(layout), b.heads.begin, b.heads.size());
  }
  at::Tensor view(const ExchangeBlock& b) const { return view(b, -1, 0, b.tokens.size()); }
  // Batch entries a message of a block is cut by (messages() below): each entry apart where the
  // batch dim comes before the sequence dim, so a message of a BSHD block is contiguous.
  int64_t message_batches() const {
    const int64_t bdim = batch_dim(layout);
    return bdim < seq_dim(layout) ? tensors[0].size(bdim) : 1;
  }
  // Received blocks are summed where they overlap in one tensor (never in parts).
  bool sums(const ExchangePlan& plan) const { return plan.sums_received() && !by_peer; }
};

// Sizes of each fused tensor of an exchange's input `xs` (its first part when `parts`, as its
// parts differ only in heads): their dims other than tokens and heads are the output's too.
using Shapes = std::vector<std::vector<int64_t>>;
inline Shapes shapes_of(const std::vector<at::Tensor>& xs, bool parts, int64_t peers) {
  Shapes out;
  for (size_t i = 0; i < xs.size(); i += parts ? peers : 1) out.push_back(xs[i].sizes().vec());
  return out;
}

// Fresh tensors for the receiving side of `plan`: whole outputs (zeroed where received blocks
// are summed), or one part per peer. `like` gives the other dims, per fused tensor.
inline BlockTensors new_outputs(const Shapes& like, const at::TensorOptions& options,
                                const ExchangePlan& plan, Layout layout, bool by_peer,
                                const Group& group) {
  BlockTensors out{{}, by_peer, layout, group.size()};
  if (by_peer) {
    out.tensors.resize(like.size() * group.size());
    for (const ExchangeBlock& b : plan.recv()) {
      out.tensors[b.tensor * group.size() + b.peer] = group.new_buffer(
          shape_with(like[b.tensor], layout, b.tokens.size(), b.heads.size()), options);
    }
    return out;
  }
  for (size_t t = 0; t < like.size(); ++t) {
    const Extent e = plan.outputs()[t];
    out.tensors.push_back(
        group.new_buffer(shape_with(like[t], layout, e.tokens, e.heads), options));
    if (plan.sums_received()) out.tensors.back().zero_();
  }
  return out;
}

// Copies `src` into `dst`, or adds it where `out` sums received blocks.
inline void put_block(const at::Tensor& dst, const at::Tensor& src, const BlockTensors& out,
                      const ExchangePlan& plan) {
  if (out.sums(plan)) {
    dst.add_(src);
  } else {
    dst.copy_(src);
  }
}

// Copies the blocks of `in` that `keep` picks into the flat buffer at `base`, where element
// `start` of the flat send buffer of one collective sits (blocks lie there at `offset`).
template <class Keep>
void pack_blocks(uint8_t* base, int64_t start, const std::vector<ExchangeBlock>& blocks,
                 const BlockTensors& in, Keep keep) {
  for (const ExchangeBlock& b : blocks) {
    if (b.numel == 0 || !keep(b)) continue;
    const at::Tensor src = in.view(b);
    at::from_blob(base + (b.offset - start) * src.element_size(), src.sizes(), src.options())
        .copy_(src);
  }
}

// Puts the received blocks of `plan` that `keep` picks in place in `out` (or adds them) from the
// flat buffer at `base`, where element `start` of the flat receive buffer sits.
template <class Keep>
void unpack_blocks(const uint8_t* base, int64_t start, const ExchangePlan& plan,
                   const BlockTensors& out, Keep keep) {
  for (const ExchangeBlock& b : plan.recv()) {
    if (b.numel == 0 || !keep(b)) continue;
    const at::Tensor dst = out.view(b);
    const at::Tensor src =
        at::from_blob(const_cast<uint8_t*>(base) + (b.offset - start) * dst.element_size(),
                      dst.sizes(), dst.options());
    put_block(dst, src, out, plan);
  }
}

// Copies this rank's own blocks (of fused tensor `tensor`; -1: all) from `in` to `out`: its send
// and receive blocks for itself come in the same order.
inline void copy_own_blocks(const BlockTensors& in, const BlockTensors& out,
                            const ExchangePlan& plan, int me, int64_t tensor = -1) {
  std::vector<const ExchangeBlock*> sent;
  for (const ExchangeBlock& b : plan.send())
    if (b.peer == me) sent.push_back(&b);
  size_t i = 0;
  for (const ExchangeBlock& b : plan.recv()) {
    if (b.peer != me) continue;
    const ExchangeBlock& s = *sent[i++];
    if (tensor < 0 || s.tensor == tensor) put_block(out.view(b), in.view(s), out, plan);
  }
}

// One piece of a block, as the pipelined exchange sends it in a message and the flag handshake
// in a window: `count` tokens of `block` from its token `first`, of batch entry `batch` (-1: all).
// `numel`: its elements.
struct Message {
  const ExchangeBlock* block;
  int64_t batch, first, count, numel;
};

// The messages to or from `peer` over `blocks`, in block order: the blocks' slabs (per batch
// entry when `batches` > 1, so that in BSHD a message is contiguous wherever its heads are), each
// at most `max_elements` (at least one token). Both ends cut mirrored blocks alike (same token
// counts, batch and elements per token).
inline std::vector<Message> messages(const std::vector<ExchangeBlock>& blocks, int64_t peer,
                                     int64_t max_elements, int64_t batches) {
  std::vector<Message> out;
  for (const ExchangeBlock& b : blocks) {
    if (b.peer != peer || b.numel == 0) continue;
    const int64_t n = b.tokens.size(), per_token = b.numel / n / batches;
    for (const detail::Slab& s : detail::slabs(batches, n, per_token, max_elements)) {
      out.push_back({&b, batches > 1 ? s.batch : -1, s.first, s.count, s.count * per_token});
    }
  }
  return out;
}

// Prefix sums of `splits`: element offsets of each peer's chunk in a flat buffer, and the end.
inline std::vector<int64_t> chunk_starts(const std::vector<int64_t>& splits) {
  std::vector<int64_t> starts{0};
  for (int64_t n : splits) starts.push_back(starts.back() + n);
  return starts;
}

}  // namespace ulysses
