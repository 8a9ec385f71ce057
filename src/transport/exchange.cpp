#include "transport/exchange.h"

#include <algorithm>
#include <memory>

#include "transport/environment.h"
#include "transport/exchange_blocks.h"
#include "transport/group_runtime.h"
#include "transport/message_tags.h"
#include "transport/shared_exchange.h"
#include "transport/shared_memory.h"
#include "transport/shared_transfer.h"
#include "transport/transfers.h"
#include "transport/wire.h"

namespace ulysses {
namespace {

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
  const int64_t batches = in.message_batches();
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
  copy_own_blocks(in, out, plan, me);
  if (shared) shared->finish();
  for (Arrival& a : arrivals) {
    io.wait(a.transfer);
    if (a.staged.defined()) put_block(a.dst, a.staged, out, plan);
  }
  io.wait();
}

}  // namespace

// Executes `plan` from `xs` (whole tensors, or parts by peer) into fresh outputs (whole, or
// parts by peer). CPU exchanges between ranks all on one host go through shared memory with no
// message (Note [Flag handshake]: faster than messages or a collective at every size measured);
// otherwise large CPU exchanges go as pipelined messages (GroupOptions::pipeline_min_bytes), the
// rest in one collective. Every rank decides alike, from sizes the plan has the same on every
// rank and from links every rank knows alike.
std::vector<at::Tensor> exchange(const std::vector<at::Tensor>& xs, HeadForm from,
                                 const ExchangePlan& plan, Layout layout, HeadForm to,
                                 const Group& group) {
  const bool parts_in = from == HeadForm::kParts, parts_out = to == HeadForm::kParts;
  const BlockTensors in{xs, parts_in, layout, group.size()};
  BlockTensors out = new_outputs(shapes_of(xs, parts_in, group.size()), xs[0].options(), plan,
                                 layout, parts_out, group);
  const int64_t bytes_per_rank = plan.total_elements() * xs[0].element_size() / group.size();
  // Batched transport: collectives and batched transfers only (GroupOptions::transport).
  const bool host = xs[0].device().is_cpu() && !batches(group, c10::DeviceType::CPU);
  if (host && uses_shared_memory(group.options()) &&
      exchange_through_outboxes(in, out, plan, group)) {
    return std::move(out.tensors);
  }
  if (host && bytes_per_rank >= group.options().pipeline_min_bytes) {
    exchange_pipelined(in, out, plan, group);
  } else {
    exchange_collective(in, out, plan, group);
  }
  return std::move(out.tensors);
}

bool cpu_exchanges_wait_on_links(const Group& group) {
  if (group.size() == 1) return false;
  if (batches(group, c10::DeviceType::CPU) || !uses_shared_memory(group.options())) return true;
  return !group.runtime().links(group).all_linked();
}

}  // namespace ulysses
