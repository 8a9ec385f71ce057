#include "ulysses/all_to_all.h"

#include <c10/util/Exception.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

#include "transport/agreement.h"
#include "transport/environment.h"
#include "transport/group_runtime.h"
#include "transport/message_tags.h"
#include "transport/ops.h"
#include "transport/shared_memory.h"
#include "transport/slabs.h"
#include "transport/transfers.h"
#include "transport/wire.h"
#include "ulysses/attention.h"
#include "ulysses/mask_decision.h"

namespace ulysses {
namespace {

using detail::heads_word;
using detail::shape_str;

// `like`'s sizes with the sequence dim set to `seq` and the head dim to `heads`.
std::vector<int64_t> shape_with(at::IntArrayRef like, Layout layout, int64_t seq, int64_t heads) {
  std::vector<int64_t> s = like.vec();
  s[seq_dim(layout)] = seq;
  s[head_dim(layout)] = heads;
  return s;
}

// True when every dim before `dim` has size 1, so slices along `dim` are contiguous blocks.
bool leading_dims_trivial(at::IntArrayRef sizes, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i)
    if (sizes[i] != 1) return false;
  return true;
}

// Blocks `blocks` of a tensor of `extent` tile its memory in buffer order, so the flat buffer can
// be the tensor itself: one tensor whose dims before the sequence dim are all 1, and blocks of
// all its heads over consecutive tokens.
bool tiles_in_order(const std::vector<ExchangeBlock>& blocks, const Extent& extent,
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
  // Received blocks are summed where they overlap in one tensor (never in parts).
  bool sums(const ExchangePlan& plan) const { return plan.sums_received() && !by_peer; }
};

// Sizes of each fused tensor of an exchange's input `xs` (its first part when `parts`, as its
// parts differ only in heads): their dims other than tokens and heads are the output's too.
using Shapes = std::vector<std::vector<int64_t>>;
Shapes shapes_of(const std::vector<at::Tensor>& xs, bool parts, int64_t peers) {
  Shapes out;
  for (size_t i = 0; i < xs.size(); i += parts ? peers : 1) out.push_back(xs[i].sizes().vec());
  return out;
}

// Fresh tensors for the receiving side of `plan`: whole outputs (zeroed where received blocks
// are summed), or one part per peer. `like` gives the other dims, per fused tensor.
BlockTensors new_outputs(const Shapes& like, const at::TensorOptions& options,
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
void put_block(const at::Tensor& dst, const at::Tensor& src, const BlockTensors& out,
               const ExchangePlan& plan) {
  if (out.sums(plan)) {
    dst.add_(src);
  } else {
    dst.copy_(src);
  }
}

// Executes `plan` in one collective: packs the send blocks, exchanges them and unpacks (or
// sums) the received blocks. A single whole tensor laid out block after block is sent or
// received in place, without a copy.
void exchange_collective(const BlockTensors& in, const BlockTensors& out, const ExchangePlan& plan,
                         const Group& group) {
  const int64_t sdim = seq_dim(in.layout);
  auto flat = [](const at::Tensor& buffer, const ExchangeBlock& b, const at::Tensor& like) {
    return buffer.narrow(0, b.offset, b.numel).view(like.sizes());
  };
  int64_t send_total = 0, recv_total = 0;
  for (int64_t n : plan.send_splits()) send_total += n;
  for (int64_t n : plan.recv_splits()) recv_total += n;
  const at::TensorOptions options = in.tensors[0].options();

  at::Tensor send;
  if (!in.by_peer && in.tensors.size() == 1 &&
      tiles_in_order(plan.send(), plan.inputs()[0], in.tensors[0], sdim)) {
    send = in.tensors[0].view({-1});
  } else {
    send = group.new_buffer({send_total}, options);
    for (const ExchangeBlock& b : plan.send()) {
      const at::Tensor src = in.view(b);
      flat(send, b, src).copy_(src);
    }
  }
  const bool direct = !out.by_peer && out.tensors.size() == 1 && !plan.sums_received() &&
                      tiles_in_order(plan.recv(), plan.outputs()[0], out.tensors[0], sdim);
  at::Tensor recv = direct ? out.tensors[0].view({-1}) : group.new_buffer({recv_total}, options);
  at::Tensor send_w = detail::wire_view(send), recv_w = detail::wire_view(recv);
  group.all_to_all(recv_w, send_w, plan.recv_splits(), plan.send_splits());
  if (direct) return;
  for (const ExchangeBlock& b : plan.recv()) {
    const at::Tensor dst = out.view(b);
    put_block(dst, flat(recv, b, dst), out, plan);
  }
}

using detail::kFirstMessage;

// One message of a pipelined exchange: `count` tokens of `block` from its token `first`, of
// batch entry `batch` (-1: all).
struct Message {
  const ExchangeBlock* block;
  int64_t batch, first, count;
};

// The messages to or from `peer` over `blocks`, in block order: the blocks' slabs (per batch
// entry when `batches` > 1, so that in BSHD a message is contiguous wherever its heads are).
// Both ends cut mirrored blocks alike (same token counts, batch and elements per token).
std::vector<Message> messages(const std::vector<ExchangeBlock>& blocks, int64_t peer,
                              int64_t max_elements, int64_t batches) {
  std::vector<Message> out;
  for (const ExchangeBlock& b : blocks) {
    if (b.peer != peer || b.numel == 0) continue;
    const int64_t n = b.tokens.size();
    for (const detail::Slab& s : detail::slabs(batches, n, b.numel / n / batches, max_elements)) {
      out.push_back({&b, batches > 1 ? s.batch : -1, s.first, s.count});
    }
  }
  return out;
}

// Prefix sums of `splits`: element offsets of each peer's chunk in a flat buffer, and the end.
std::vector<int64_t> chunk_starts(const std::vector<int64_t>& splits) {
  std::vector<int64_t> starts{0};
  for (int64_t n : splits) starts.push_back(starts.back() + n);
  return starts;
}

// The blocks of `plan` to and from co-located peers, through their shared-memory outboxes
// (GroupOptions::shared_memory). Each block sits in its sender's outbox where it would sit in
// the flat send buffer of one collective. post() packs this rank's blocks into its outbox and
// sends each co-located peer a notice: where that peer's blocks start, the outbox's size, and
// the errno of a failure to make room. finish() copies each peer's blocks out as its notice
// comes, tells it so, and waits until every peer has read this rank's (the outbox is then free
// for the next exchange). A rank whose outbox cannot grow (/dev/shm full) says so in its notices
// and sends its blocks for each co-located peer as one message instead; both ends then drop the
// link, so later exchanges between them go as messages (one warning, on the rank that fell
// back). A failure to map a peer's outbox completes the handshake first, then every co-located
// rank raises the lowest failing rank's error.
class SharedTransfer {
 public:
  SharedTransfer(const BlockTensors& in, const BlockTensors& out, const ExchangePlan& plan,
                 const Group& group)
      : in_(in),
        out_(out),
        plan_(plan),
        group_(group),
        links_(group.runtime().links(group)),
        io_(group, c10::DeviceType::CPU),
        element_(in.tensors[0].element_size()) {
    for (int j = 0; j < group.size(); ++j)
      if (j != group.rank() && links_.colocated(j)) peers_.push_back(j);
  }
  bool colocated(int peer) const { return links_.colocated(peer); }

  void post() {
    for (int j : peers_) {
      notices_.push_back(at::empty({4}, at::kLong));
      packed_.push_back(io_.receive(notices_.back(), j, detail::kSharedMemoryPacked));
      io_.receive(at::empty({1}, at::kLong), j, detail::kSharedMemoryRead);
    }
    const auto starts = chunk_starts(plan_.send_splits());
    int64_t need = 0;  // Bytes up to the end of the last co-located peer's chunk.
    for (int j : peers_) need = std::max(need, starts[j + 1] * element_);
    int error = 0;
    uint8_t* base = need > 0 ? links_.outbox(need, error) : nullptr;
    if (base != nullptr) {
      for (const ExchangeBlock& b : plan_.send()) {
        if (b.numel == 0 || !colocated(b.peer)) continue;
        const at::Tensor src = in_.view(b);
        at::from_blob(base + b.offset * element_, src.sizes(), src.options()).copy_(src);
      }
    }
    for (int j : peers_) {
      io_.send(
          at::tensor(std::vector<int64_t>{starts[j] * element_, links_.outbox_bytes(), error, need},
                     at::kLong),
          j, detail::kSharedMemoryPacked);
    }
    if (error != 0) fall_back(starts, need, error);
  }

  void finish() {
    const auto starts = chunk_starts(plan_.recv_splits());
    for (size_t i = 0; i < peers_.size(); ++i) {
      const int j = peers_[i];
      io_.wait(packed_[i]);
      const int64_t* n = notices_[i].data_ptr<int64_t>();  // chunk offset, size, errno, need
      if (n[2] != 0) {  // No outbox there: its blocks come as one message.
        receive_from(j, starts[j], starts[j + 1]);
        dropped_.push_back(j);
      } else if (failures_.empty()) {
        copy_from(j, n[0], n[1], starts[j], starts[j + 1]);
      }
      io_.send(at::zeros({1}, at::kLong), j, detail::kSharedMemoryRead);
    }
    io_.wait();
    // Only now: this exchange chose messages or shared memory per peer before it began.
    for (int j : dropped_) links_.drop(j);
    TORCH_CHECK(failures_.empty(), failures_.begin()->second);
  }

 private:
  // Copies `peer`'s blocks for this rank (elements [recv_start, recv_end) of the flat receive
  // buffer) out of its outbox, where they start at byte `chunk`.
  void copy_from(int peer, int64_t chunk, int64_t outbox_bytes, int64_t recv_start,
                 int64_t recv_end) {
    if (recv_start == recv_end) return;  // Nothing from it (it may have no outbox at all).
    int error = 0;
    const uint8_t* base = links_.inbox(peer, outbox_bytes, error);
    if (base == nullptr) {
      failures_.emplace(group_.rank(), "ulysses: rank " + std::to_string(group_.rank()) +
                                           " cannot map rank " + std::to_string(peer) +
                                           "'s shared-memory outbox: " + std::strerror(error));
      return;
    }
    put_blocks_from(peer, base + chunk, recv_start);
  }
  // Puts `peer`'s blocks for this rank in place from `base`, where the flat receive buffer's
  // element `recv_start` sits.
  void put_blocks_from(int peer, const uint8_t* base, int64_t recv_start) {
    for (const ExchangeBlock& b : plan_.recv()) {
      if (b.peer != peer || b.numel == 0) continue;
      const at::Tensor dst = out_.view(b);
      const at::Tensor src =
          at::from_blob(const_cast<uint8_t*>(base) + (b.offset - recv_start) * element_,
                        dst.sizes(), dst.options());
      put_block(dst, src, out_, plan_);
    }
  }
  // This rank's outbox cannot hold `need` bytes: sends each co-located peer its chunk of the flat
  // send buffer as one message, and drops the links after this exchange.
  void fall_back(const std::vector<int64_t>& starts, int64_t need, int error) {
    TORCH_WARN_ONCE("ulysses: /dev/shm cannot hold a ", need, "-byte shared-memory outbox (",
                    std::strerror(error),
                    "): blocks for ranks on this host go as messages from now on (enlarge "
                    "/dev/shm, or set ULYSSES_SHARED_MEMORY=0 to skip shared memory)");
    for (int j : peers_) {
      dropped_.push_back(j);
      if (starts[j] == starts[j + 1]) continue;
      at::Tensor chunk = group_.new_buffer({starts[j + 1] - starts[j]}, in_.tensors[0].options());
      for (const ExchangeBlock& b : plan_.send()) {
        if (b.peer != j || b.numel == 0) continue;
        const at::Tensor src = in_.view(b);
        at::from_blob(static_cast<uint8_t*>(chunk.data_ptr()) + (b.offset - starts[j]) * element_,
                      src.sizes(), src.options())
            .copy_(src);
      }
      io_.send(detail::wire_view(chunk), j, detail::kSharedMemoryFallback);
      sent_.push_back(std::move(chunk));  // Alive until the sends complete (finish).
    }
  }
  // `peer`'s blocks for this rank as one message (elements [recv_start, recv_end) of the flat
  // receive buffer), sent because its outbox could not grow.
  void receive_from(int peer, int64_t recv_start, int64_t recv_end) {
    if (recv_start == recv_end) return;
    at::Tensor chunk = group_.new_buffer({recv_end - recv_start}, out_.tensors[0].options());
    io_.wait(io_.receive(detail::wire_view(chunk), peer, detail::kSharedMemoryFallback));
    put_blocks_from(peer, static_cast<const uint8_t*>(chunk.data_ptr()), recv_start);
  }

  const BlockTensors& in_;
  const BlockTensors& out_;
  const ExchangePlan& plan_;
  const Group& group_;
  detail::SharedMemoryLinks& links_;
  Transfers io_;  // Notices; posted as added (the pipelined path is never batched).
  const int64_t element_;
  std::vector<int> peers_;  // Co-located, in rank order.
  std::vector<at::Tensor> notices_;
  std::vector<size_t> packed_;           // The notices' receives.
  std::map<int, std::string> failures_;  // By failing rank.
  std::vector<int> dropped_;             // Links dropped after this exchange.
  std::vector<at::Tensor> sent_;         // Chunks sent as messages (fall_back).
};

// Executes `plan` as point-to-point messages (CPU): every receive is posted first, straight
// into the output where a message lands contiguously; then each message is packed (unless
// contiguous already) and sent at once, so packing the next overlaps the transfer of this one;
// this rank's own blocks are copied across meanwhile, and each arrival is unpacked as it comes.
// Blocks for co-located peers go through shared memory instead when the group's options say so.
void exchange_pipelined(const BlockTensors& in, const BlockTensors& out, const ExchangePlan& plan,
                        const Group& group) {
  const int P = group.size(), me = group.rank();
  const at::Tensor& first = in.tensors[0];
  const int64_t max_elements =
      std::max<int64_t>(1, group.options().message_bytes / first.element_size());
  const int64_t bdim = batch_dim(in.layout);
  const int64_t batches = bdim < seq_dim(in.layout) ? first.size(bdim) : 1;
  struct Arrival {
    at::Tensor dst, staged;  // staged: undefined when received in place.
    size_t transfer;
  };
  Transfers io(group, c10::DeviceType::CPU);  // Posted as added (never batched here).
  std::unique_ptr<SharedTransfer> shared;
  if (uses_shared_memory(group.options()))
    shared = std::make_unique<SharedTransfer>(in, out, plan, group);
  auto by_messages = [&](int peer) { return !shared || !shared->colocated(peer); };
  std::vector<Arrival> arrivals;
  for (int k = 1; k < P; ++k) {
    const int from = (me + P - k) % P;
    if (!by_messages(from)) continue;
    const auto in_msgs = messages(plan.recv(), from, max_elements, batches);
    for (size_t i = 0; i < in_msgs.size(); ++i) {
      const Message& m = in_msgs[i];
      Arrival a{out.view(*m.block, m.batch, m.first, m.count), {}, 0};
      const bool in_place = !out.sums(plan) && a.dst.is_contiguous();
      if (!in_place) a.staged = group.new_buffer(a.dst.sizes(), a.dst.options());
      a.transfer = io.receive(detail::wire_view(in_place ? a.dst : a.staged), from,
                              kFirstMessage + static_cast<int>(i));
      arrivals.push_back(std::move(a));
    }
  }
  if (shared) shared->post();
  for (int k = 1; k < P; ++k) {
    const int to = (me + k) % P;
    if (!by_messages(to)) continue;
    const auto out_msgs = messages(plan.send(), to, max_elements, batches);
    for (size_t i = 0; i < out_msgs.size(); ++i) {
      const Message& m = out_msgs[i];
      at::Tensor src = in.view(*m.block, m.batch, m.first, m.count);
      if (!src.is_contiguous()) src = group.new_buffer(src.sizes(), src.options()).copy_(src);
      io.send(detail::wire_view(src), to, kFirstMessage + static_cast<int>(i));
    }
  }
  // This rank's own blocks: its send and receive blocks for itself come in the same order.
  auto own = [&](const std::vector<ExchangeBlock>& blocks) {
    std::vector<const ExchangeBlock*> mine;
    for (const ExchangeBlock& b : blocks)
      if (b.peer == me) mine.push_back(&b);
    return mine;
  };
  const auto own_send = own(plan.send()), own_recv = own(plan.recv());
  for (size_t i = 0; i < own_send.size(); ++i) {
    put_block(out.view(*own_recv[i]), in.view(*own_send[i]), out, plan);
  }
  if (shared) shared->finish();
  for (Arrival& a : arrivals) {
    io.wait(a.transfer);
    if (a.staged.defined()) put_block(a.dst, a.staged, out, plan);
  }
  io.wait();
}

// Executes `plan` from `xs` (whole tensors, or parts by peer) into fresh outputs (whole, or
// parts by peer): large CPU exchanges as pipelined messages, the
// rest in one collective (GroupOptions::pipeline_min_bytes). Every rank decides alike, from
// sizes the plan has the same on every rank.
std::vector<at::Tensor> exchange(const std::vector<at::Tensor>& xs, HeadForm from,
                                 const ExchangePlan& plan, Layout layout, HeadForm to,
                                 const Group& group) {
  const bool parts_in = from == HeadForm::kParts, parts_out = to == HeadForm::kParts;
  const BlockTensors in{xs, parts_in, layout, group.size()};
  BlockTensors out = new_outputs(shapes_of(xs, parts_in, group.size()), xs[0].options(), plan,
                                 layout, parts_out, group);
  const int64_t bytes_per_rank = plan.total_elements() * xs[0].element_size() / group.size();
  // Batched transport: collectives and batched transfers only (GroupOptions::transport).
  if (xs[0].device().is_cpu() && !batches(group, c10::DeviceType::CPU) &&
      bytes_per_rank >= group.options().pipeline_min_bytes) {
    exchange_pipelined(in, out, plan, group);
  } else {
    exchange_collective(in, out, plan, group);
  }
  return std::move(out.tensors);
}

// The sequence -> heads exchange of `xs` on this rank (elements per (token, head) read from
// the tensors).
ExchangePlan seq_to_heads_plan(const std::vector<at::Tensor>& xs,
                               const std::vector<Heads>& tensor_heads, const Sharding& plan,
                               const Group& group) {
  std::vector<int64_t> elements;
  for (const at::Tensor& x : xs) {
    elements.push_back(c10::multiply_integers(shape_with(x.sizes(), plan.layout, 1, 1)));
  }
  return ExchangePlan::seq_to_heads(plan.heads, plan.seq, group.rank(), tensor_heads, elements);
}

// Checks that `xs` match the agreed plan on this rank (`seq_sharded`: before scatter).
void check_against_plan(const char* op, const std::vector<at::Tensor>& xs,
                        const std::vector<Heads>& tensor_heads, const Sharding& plan,
                        const Group& group, bool seq_sharded) {
  TORCH_CHECK_VALUE(!xs.empty() && xs.size() == tensor_heads.size(), op,
                    ": need one Heads kind per tensor; got ", xs.size(), " tensors and ",
                    tensor_heads.size(), " tensor_heads");
  TORCH_CHECK_VALUE(plan.heads.sp_size() == group.size(), op, ": plan is for ",
                    plan.heads.sp_size(), " ranks but the group has ", group.size());
  const int me = group.rank();
  const int64_t sdim = seq_dim(plan.layout), hdim = head_dim(plan.layout);
  for (size_t t = 0; t < xs.size(); ++t) {
    const at::Tensor& x = xs[t];
    TORCH_CHECK_VALUE(x.dim() == 4, op, ": tensor ", t, " must be 4-D (", to_string(plan.layout),
                      "); got shape ", shape_str(x.sizes()), " (rank ", me, ")");
    TORCH_CHECK_TYPE(x.scalar_type() == xs[0].scalar_type(), op,
                     ": fused tensors must share a dtype; got ", x.scalar_type(), " and ",
                     xs[0].scalar_type());
    const int64_t want_s = seq_sharded ? plan.seq.length(me) : plan.seq.seq_len();
    const int64_t want_h =
        seq_sharded ? plan.total(tensor_heads[t]) : plan.ranges(tensor_heads[t])[me].size();
    TORCH_CHECK_VALUE(x.size(sdim) == want_s && x.size(hdim) == want_h, op, ": tensor ", t,
                      " must have ", want_s, " tokens in dim ", sdim, " and ", want_h, " ",
                      heads_word(tensor_heads[t]), " heads in dim ", hdim, " (layout ",
                      to_string(plan.layout), "); got shape ", shape_str(x.sizes()), " (rank ", me,
                      " of ", group.size(), ")");
  }
}

// The first of `parts` (one per rank) that does not hold its rank's heads `ranges[j]` in
// `layout` with part 0's other dims, dtype and device; -1 when all fit.
int64_t first_misfit_part(const std::vector<at::Tensor>& parts, const std::vector<Range>& ranges,
                          Layout layout) {
  const int64_t hdim = head_dim(layout);
  for (size_t j = 0; j < parts.size(); ++j) {
    const at::Tensor& p = parts[j];
    bool ok = p.defined() && p.dim() == 4 && p.size(hdim) == ranges[j].size() &&
              p.scalar_type() == parts[0].scalar_type() && p.device() == parts[0].device();
    for (int64_t d = 0; ok && d < 4; ++d) ok = d == hdim || p.size(d) == parts[0].size(d);
    if (!ok) return static_cast<int64_t>(j);
  }
  return -1;
}

// Checks that `parts` are this rank's tokens of every rank's heads, by the agreed plan.
void check_parts(const char* op, const std::vector<at::Tensor>& parts, Heads kind,
                 const Sharding& plan, const Group& group) {
  const auto& ranges = plan.ranges(kind);
  TORCH_CHECK_VALUE(parts.size() == ranges.size() && plan.heads.sp_size() == group.size(), op,
                    ": need one part per rank of the group (", group.size(), "); got ",
                    parts.size());
  const int64_t sdim = seq_dim(plan.layout), hdim = head_dim(plan.layout);
  const int64_t tokens = plan.seq.length(group.rank());
  // Parts that fit have part 0's token count: then part 0's is the one to check.
  int64_t j = first_misfit_part(parts, ranges, plan.layout);
  if (j < 0 && parts[0].size(sdim) != tokens) j = 0;
  // The message (built only on failure) reads parts[j].
  TORCH_CHECK_VALUE(j < 0, op, ": part ", j, " must hold ", ranges[j].size(), " ", heads_word(kind),
                    " heads in dim ", hdim, " and ", tokens, " tokens in dim ", sdim, " (layout ",
                    to_string(plan.layout), "), with part 0's dtype, device and other dims; got ",
                    parts[j].defined() ? shape_str(parts[j].sizes()) : "undefined", " (rank ",
                    group.rank(), ")");
}

}  // namespace

namespace detail {

std::vector<at::Tensor> scatter_heads_kernel(const std::vector<at::Tensor>& xs,
                                             const std::vector<Heads>& tensor_heads,
                                             const Sharding& plan, const Group& group) {
  check_against_plan("scatter_heads", xs, tensor_heads, plan, group, /*seq_sharded=*/true);
  if (group.size() == 1) return xs;
  at::NoGradGuard no_grad;
  return exchange(xs, HeadForm::kWhole, seq_to_heads_plan(xs, tensor_heads, plan, group),
                  plan.layout, HeadForm::kWhole, group);
}

std::vector<at::Tensor> gather_heads_kernel(const std::vector<at::Tensor>& ys,
                                            const std::vector<Heads>& tensor_heads,
                                            const Sharding& plan, const Group& group,
                                            HeadForm out) {
  check_against_plan(out == HeadForm::kParts ? "gather_head_parts" : "gather_heads", ys,
                     tensor_heads, plan, group, /*seq_sharded=*/false);
  if (group.size() == 1) {
    if (out == HeadForm::kWhole) return ys;
    std::vector<at::Tensor> parts;  // One part per rank: the tensor itself.
    for (const at::Tensor& y : ys) parts.push_back(y);
    return parts;
  }
  at::NoGradGuard no_grad;
  return exchange(ys, HeadForm::kWhole, seq_to_heads_plan(ys, tensor_heads, plan, group).reversed(),
                  plan.layout, out, group);
}

std::vector<at::Tensor> scatter_head_parts_kernel(const std::vector<std::vector<at::Tensor>>& parts,
                                                  const std::vector<Heads>& tensor_heads,
                                                  const Sharding& plan, const Group& group) {
  TORCH_CHECK_VALUE(!parts.empty() && parts.size() == tensor_heads.size(),
                    "scatter_head_parts: need one Heads kind per tensor; got ", parts.size(),
                    " tensors and ", tensor_heads.size(), " tensor_heads");
  std::vector<at::Tensor> flat, firsts;
  for (size_t t = 0; t < parts.size(); ++t) {
    check_parts("scatter_head_parts", parts[t], tensor_heads[t], plan, group);
    TORCH_CHECK_TYPE(parts[t][0].scalar_type() == parts[0][0].scalar_type(),
                     "scatter_head_parts: fused tensors must share a dtype; got ",
                     parts[t][0].scalar_type(), " and ", parts[0][0].scalar_type());
    flat.insert(flat.end(), parts[t].begin(), parts[t].end());
    firsts.push_back(parts[t][0]);
  }
  if (group.size() == 1) return firsts;
  at::NoGradGuard no_grad;
  return exchange(flat, HeadForm::kParts, seq_to_heads_plan(firsts, tensor_heads, plan, group),
                  plan.layout, HeadForm::kWhole, group);
}

}  // namespace detail

std::vector<at::Tensor> scatter_heads(const std::vector<at::Tensor>& xs,
                                      const std::vector<Heads>& tensor_heads, const Sharding& plan,
                                      const Group& group) {
  check_against_plan("scatter_heads", xs, tensor_heads, plan, group, /*seq_sharded=*/true);
  if (group.size() == 1) return xs;
  return detail::call_scatter_heads(xs, tensor_heads, plan, group);
}

std::vector<at::Tensor> gather_heads(const std::vector<at::Tensor>& ys,
                                     const std::vector<Heads>& tensor_heads, const Sharding& plan,
                                     const Group& group) {
  check_against_plan("gather_heads", ys, tensor_heads, plan, group, /*seq_sharded=*/false);
  if (group.size() == 1) return ys;
  return detail::call_gather_heads(ys, tensor_heads, plan, group, HeadForm::kWhole);
}

at::Tensor scatter_heads(const at::Tensor& x, Heads heads, const Sharding& plan,
                         const Group& group) {
  return scatter_heads(std::vector<at::Tensor>{x}, {heads}, plan, group)[0];
}

at::Tensor gather_heads(const at::Tensor& y, Heads heads, const Sharding& plan,
                        const Group& group) {
  return gather_heads(std::vector<at::Tensor>{y}, {heads}, plan, group)[0];
}

std::vector<at::Tensor> scatter_head_parts(const std::vector<std::vector<at::Tensor>>& parts,
                                           const std::vector<Heads>& tensor_heads,
                                           const Sharding& plan, const Group& group) {
  if (group.size() == 1) return detail::scatter_head_parts_kernel(parts, tensor_heads, plan, group);
  return detail::call_scatter_head_parts(parts, tensor_heads, plan, group);
}

at::Tensor scatter_head_parts(const std::vector<at::Tensor>& parts, Heads heads,
                              const Sharding& plan, const Group& group) {
  return scatter_head_parts(std::vector<std::vector<at::Tensor>>{parts}, {heads}, plan, group)[0];
}

std::vector<at::Tensor> gather_head_parts(const std::vector<at::Tensor>& ys,
                                          const std::vector<Heads>& tensor_heads,
                                          const Sharding& plan, const Group& group) {
  check_against_plan("gather_head_parts", ys, tensor_heads, plan, group, /*seq_sharded=*/false);
  if (group.size() == 1) return ys;
  return detail::call_gather_heads(ys, tensor_heads, plan, group, HeadForm::kParts);
}

std::vector<at::Tensor> gather_head_parts(const at::Tensor& y, Heads heads, const Sharding& plan,
                                          const Group& group) {
  return gather_head_parts(std::vector<at::Tensor>{y}, {heads}, plan, group);
}

at::Tensor stand_in_for_parts(const std::vector<at::Tensor>& parts, Heads kind,
                              const HeadPartition& partition, Layout layout,
                              const std::string& who) {
  const auto& ranges = kind == Heads::kQuery ? partition.q_ranges() : partition.kv_ranges();
  const int64_t hdim = head_dim(layout);
  TORCH_CHECK_VALUE(parts.size() == ranges.size(), who, " needs one part per rank (", ranges.size(),
                    "); got ", parts.size());
  const int64_t j = first_misfit_part(parts, ranges, layout);
  // The message (built only on failure) reads parts[j].
  TORCH_CHECK_VALUE(j < 0, who, " part ", j, " must be 4-D (", to_string(layout), ") with ",
                    ranges[j].size(), " heads in dim ", hdim,
                    " and part 0's other dims, dtype and device; got ",
                    parts[j].defined() ? shape_str(parts[j].sizes()) : "undefined");
  bool grad = false;
  for (const at::Tensor& p : parts) grad = grad || p.requires_grad();
  std::vector<int64_t> shape = parts[0].sizes().vec();
  shape[hdim] = ranges.back().end;
  return parts[0].new_empty({1, 1, 1, 1}).requires_grad_(grad).expand(shape);
}

void check_head_projection(const std::vector<int64_t>& x, const std::vector<int64_t>& weight,
                           const c10::optional<std::vector<int64_t>>& bias,
                           const std::vector<Range>& ranges) {
  const int64_t H = ranges.empty() ? 0 : ranges.back().end;
  TORCH_CHECK_VALUE(x.size() == 3 && weight.size() == 2 && H > 0 && weight[0] % H == 0 &&
                        weight[1] == x[2] && (!bias || *bias == std::vector<int64_t>{weight[0]}),
                    "project_head_parts: need x [B, S, E], weight [H x D, E] for the ", H,
                    " heads of the ranges and bias [H x D] or none; got x ", c10::IntArrayRef(x),
                    ", weight ", c10::IntArrayRef(weight), bias ? ", bias " : "",
                    bias ? shape_str(*bias) : "");
}

void check_projection_from_parts(const std::vector<std::vector<int64_t>>& parts,
                                 const std::vector<int64_t>& weight,
                                 const std::vector<Range>& ranges) {
  TORCH_CHECK_VALUE(!parts.empty() && parts.size() == ranges.size() && weight.size() == 2,
                    "project_from_head_parts: need one part per head range and a 2-D weight; got ",
                    parts.size(), " parts, ", ranges.size(), " ranges, weight ",
                    c10::IntArrayRef(weight));
  const int64_t H = ranges.back().end;
  for (size_t j = 0; j < parts.size(); ++j) {
    const auto& p = parts[j];
    TORCH_CHECK_VALUE(p.size() == 4 && p[2] == ranges[j].size() && weight[1] % H == 0 &&
                          weight[1] / H == p[3] && p[0] == parts[0][0] && p[1] == parts[0][1],
                      "project_from_head_parts: part ", j, " must be [B, S, ", ranges[j].size(),
                      ", D] with D = weight's columns / heads and part 0's B and S; got ",
                      c10::IntArrayRef(p), " and weight ", c10::IntArrayRef(weight));
  }
}

std::vector<at::Tensor> project_head_parts(const at::Tensor& x, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias,
                                           const std::vector<Range>& ranges) {
  check_head_projection(
      x.sizes().vec(), weight.sizes().vec(),
      bias ? c10::optional<std::vector<int64_t>>(bias->sizes().vec()) : c10::nullopt, ranges);
  const int64_t D = weight.size(0) / ranges.back().end;
  std::vector<at::Tensor> parts;
  for (const Range& r : ranges) {
    const at::Tensor w = weight.narrow(0, r.begin * D, r.size() * D);
    const c10::optional<at::Tensor> b =
        bias ? c10::optional<at::Tensor>(bias->narrow(0, r.begin * D, r.size() * D)) : c10::nullopt;
    parts.push_back(at::linear(x, w, b).view({x.size(0), x.size(1), r.size(), D}));
  }
  return parts;
}

at::Tensor project_from_head_parts(const std::vector<at::Tensor>& parts, const at::Tensor& weight,
                                   const std::vector<Range>& ranges) {
  std::vector<std::vector<int64_t>> sizes;
  for (const at::Tensor& p : parts) sizes.push_back(p.sizes().vec());
  check_projection_from_parts(sizes, weight.sizes().vec(), ranges);
  at::Tensor out;
  for (size_t j = 0; j < parts.size(); ++j) {
    const at::Tensor& p = parts[j];
    const int64_t D = p.size(3);
    const at::Tensor y =
        at::linear(p.flatten(2), weight.narrow(1, ranges[j].begin * D, p.size(2) * D));
    out = out.defined() ? out + y : y;
  }
  return out;
}

at::Tensor scatter_heads(const at::Tensor& x, const HeadPartition& partition, Heads heads,
                         Layout layout, const Group& group) {
  auto plan = agree_plan(group, partition, layout, {TensorSpec{x, heads, "x"}});
  return scatter_heads(x, heads, plan, group);
}

}  // namespace ulysses
