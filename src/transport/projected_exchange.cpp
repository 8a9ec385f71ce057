// Projections overlapped with the exchanges: scatter_projected, gather_projected and their
// backward passes, on Transfers (one message per slab, every receive added first).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "transport/message_tags.h"
#include "transport/ops.h"
#include "transport/slabs.h"
#include "transport/transfers.h"
#include "transport/wire.h"
#include "ulysses/all_to_all.h"

namespace ulysses {
namespace {

using detail::kFirstMessage;
using detail::Slab;
using detail::slabs;

// Slab `s` of `t` [B, tokens, ...] from token `offset` on, as [count, rest] (contiguous when `t`
// is).
at::Tensor rows(const at::Tensor& t, const Slab& s, int64_t offset = 0) {
  return t.select(0, s.batch).narrow(0, offset + s.first, s.count).flatten(1);
}

// The call's slabs on the group's transport (Transfers): every receive is added first, then
// the sends as they are computed; post() before this rank's own part, whose compute then
// overlaps the transfers. Empty slabs move nothing, alike on both ranks.
struct SlabTransfers {
  static constexpr size_t kNothing = SIZE_MAX;
  Transfers io;
  SlabTransfers(const Group& group, const at::Tensor& like) : io(group, like.device().type()) {}
  void send(const at::Tensor& t, int to, int tag) {
    if (t.numel() > 0) io.send(detail::wire_view(t), to, tag);
  }
  size_t receive(const at::Tensor& t, int from, int tag) {
    return t.numel() == 0 ? kNothing : io.receive(detail::wire_view(t), from, tag);
  }
  void post() { io.post(); }
  void wait(size_t n) {
    if (n != kNothing) io.wait(n);
  }
  void finish() { io.wait(); }
};

// A received slab of projection `t` from (or for) rank `peer`, and where it belongs.
struct Arrival {
  size_t transfer;
  at::Tensor data;
  Slab slab;
  size_t t;
  int peer;
};

// What scatter_projected reads of its projections: rank j's rows of each weight and bias.
struct InputProjections {
  const std::vector<HeadProjection>& projections;
  const Sharding& sharding;

  int64_t head_dim(size_t t) const {
    return projections[t].weight.size(0) / sharding.total(projections[t].heads);
  }
  Range range(size_t t, int j) const { return sharding.ranges(projections[t].heads)[j]; }
  // Rows of `w` (a weight, bias or their gradient) that project rank j's heads of projection t.
  at::Tensor rows_of(const at::Tensor& w, size_t t, int j) const {
    const Range r = range(t, j);
    return w.narrow(0, r.begin * head_dim(t), r.size() * head_dim(t));
  }
  // Elements per token that rank j receives from each rank.
  int64_t per_token(int j) const {
    int64_t n = 0;
    for (size_t t = 0; t < projections.size(); ++t) n += range(t, j).size() * head_dim(t);
    return n;
  }
  // x_rows [n, E] projected for rank j's heads of projection t, into `out` [n, |R| x D].
  void project(const at::Tensor& x_rows, size_t t, int j, at::Tensor& out) const {
    const HeadProjection& p = projections[t];
    const at::Tensor w = rows_of(p.weight, t, j).t();
    if (p.bias) {
      at::addmm_out(out, rows_of(*p.bias, t, j), x_rows, w);
    } else {
      at::mm_out(out, x_rows, w);
    }
  }
  at::Tensor project(const at::Tensor& x_rows, size_t t, int j) const {
    at::Tensor out =
        at::empty({x_rows.size(0), range(t, j).size() * head_dim(t)}, x_rows.options());
    project(x_rows, t, j, out);
    return out;
  }
};

int64_t max_elements(const Group& group, const at::Tensor& like) {
  return std::max<int64_t>(1, group.options().message_bytes / like.element_size());
}

// Columns of `w` [E, Hq x D] (or its gradient) that take rank j's heads.
at::Tensor columns(const at::Tensor& w, const Sharding& sharding, int j, int64_t D) {
  const Range r = sharding.ranges(Heads::kQuery)[j];
  return w.narrow(1, r.begin * D, r.size() * D);
}

// This rank's checks of scatter_projected's inputs against `heads` (x holding `tokens`
// tokens); returns each projection's head dim.
std::vector<int64_t> check_input_projections(const char* op, const at::Tensor& x,
                                             const std::vector<HeadProjection>& projections,
                                             const HeadPartition& heads, int64_t tokens) {
  TORCH_CHECK_VALUE(x.defined() && x.dim() == 3, op, ": x must be [B, S_r, E]; got ",
                    x.defined() ? c10::str(x.sizes()) : "undefined");
  TORCH_CHECK_VALUE(x.size(1) == tokens, op, ": x must hold this rank's ", tokens,
                    " tokens in dim 1; got shape ", x.sizes());
  TORCH_CHECK_VALUE(!projections.empty(), op, ": need at least one projection");
  std::vector<int64_t> dims;
  for (size_t t = 0; t < projections.size(); ++t) {
    const HeadProjection& p = projections[t];
    const int64_t H = p.heads == Heads::kQuery ? heads.q_heads() : heads.kv_heads();
    TORCH_CHECK_VALUE(p.weight.defined() && p.weight.dim() == 2 && p.weight.size(1) == x.size(2) &&
                          p.weight.size(0) % H == 0 && p.weight.size(0) > 0,
                      op, ": projection ", t, "'s weight must be [", H, " ", heads_word(p.heads),
                      " heads x D, ", x.size(2), "]; got ",
                      p.weight.defined() ? c10::str(p.weight.sizes()) : "undefined");
    TORCH_CHECK_VALUE(!p.bias || (p.bias->dim() == 1 && p.bias->size(0) == p.weight.size(0)), op,
                      ": projection ", t, "'s bias must be [", p.weight.size(0), "]; got ",
                      p.bias ? c10::str(p.bias->sizes()) : "");
    for (const at::Tensor& w : {p.weight, p.bias ? *p.bias : p.weight}) {
      TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), op, ": projection ", t, " is ",
                       w.scalar_type(), " but x is ", x.scalar_type(), "; give them one dtype");
      TORCH_CHECK_VALUE(w.device() == x.device(), op, ": projection ", t, " is on ", w.device(),
                        " but x is on ", x.device());
    }
    dims.push_back(p.weight.size(0) / H);
  }
  return dims;
}

void check_plan(const char* op, const Sharding& sharding, const Group& group) {
  TORCH_CHECK_VALUE(sharding.layout == Layout::kBSHD, op, ": the layout must be BSHD; got ",
                    to_string(sharding.layout));
  TORCH_CHECK_VALUE(sharding.heads.sp_size() == group.size(), op, ": sharding is for ",
                    sharding.heads.sp_size(), " ranks but the group has ", group.size());
}

}  // namespace

namespace detail {

void check_scatter_projected(const at::Tensor& x, const std::vector<HeadProjection>& projections,
                             const Sharding& sharding, const Group& group) {
  check_plan("scatter_projected", sharding, group);
  check_input_projections("scatter_projected", x, projections, sharding.heads,
                          sharding.seq.length(group.rank()));
}

void check_gather_projected(const at::Tensor& y, const at::Tensor& weight, const Sharding& sharding,
                            const Group& group) {
  check_plan("gather_projected", sharding, group);
  const int me = group.rank();
  const int64_t Hq = sharding.heads.q_heads(), mine = sharding.ranges(Heads::kQuery)[me].size();
  TORCH_CHECK_VALUE(
      y.defined() && y.dim() == 4 && y.size(1) == sharding.seq.seq_len() && y.size(2) == mine,
      "gather_projected: y must be [B, ", sharding.seq.seq_len(), ", ", mine,
      ", D] (all tokens of this rank's query heads); got ",
      y.defined() ? c10::str(y.sizes()) : "undefined", " (rank ", me, ")");
  TORCH_CHECK_VALUE(weight.defined() && weight.dim() == 2 && weight.size(1) == Hq * y.size(3),
                    "gather_projected: weight must be [E, ", Hq, " query heads x ", y.size(3),
                    "]; got ", weight.defined() ? c10::str(weight.sizes()) : "undefined");
  TORCH_CHECK_TYPE(weight.scalar_type() == y.scalar_type(), "gather_projected: weight is ",
                   weight.scalar_type(), " but y is ", y.scalar_type(), "; give them one dtype");
  TORCH_CHECK_VALUE(weight.device() == y.device(), "gather_projected: weight is on ",
                    weight.device(), " but y is on ", y.device());
}

std::vector<at::Tensor> scatter_projected_kernel(const at::Tensor& x,
                                                 const std::vector<HeadProjection>& projections,
                                                 const Sharding& sharding, const Group& group) {
  const InputProjections in{projections, sharding};
  const int P = group.size(), me = group.rank();
  const int64_t B = x.size(0), mine = sharding.seq.length(me), limit = max_elements(group, x);
  std::vector<at::Tensor> ys;
  for (size_t t = 0; t < in.projections.size(); ++t) {
    ys.push_back(at::empty({B, sharding.seq.seq_len(), in.range(t, me).size(), in.head_dim(t)},
                           x.options()));
  }
  SlabTransfers io(group, x);
  for (int k = 1; k < P; ++k) {
    const int from = (me + P - k) % P;
    int tag = kFirstMessage;
    for (const Slab& s : slabs(B, sharding.seq.length(from), in.per_token(me), limit)) {
      for (const at::Tensor& y : ys) {
        io.receive(rows(y, s, sharding.seq.range(from).begin), from, tag++);
      }
    }
  }
  for (int k = 1; k < P; ++k) {
    const int to = (me + k) % P;
    int tag = kFirstMessage;
    for (const Slab& s : slabs(B, mine, in.per_token(to), limit)) {
      for (size_t t = 0; t < ys.size(); ++t) io.send(in.project(rows(x, s), t, to), to, tag++);
    }
  }
  io.post();
  // This rank's own heads, straight into the outputs, while the slabs travel.
  for (size_t t = 0; t < ys.size(); ++t) {
    for (int64_t b = 0; b < B; ++b) {
      const Slab s{b, 0, mine};
      at::Tensor dst = rows(ys[t], s, sharding.seq.range(me).begin);
      in.project(rows(x, s), t, me, dst);
    }
  }
  io.finish();
  return ys;
}

std::vector<at::Tensor> scatter_projected_backward_kernel(
    const std::vector<at::Tensor>& grads, const at::Tensor& x,
    const std::vector<HeadProjection>& projections, const Sharding& sharding, const Group& group) {
  const InputProjections in{projections, sharding};
  const int P = group.size(), me = group.rank();
  const int64_t B = x.size(0), mine = sharding.seq.length(me), limit = max_elements(group, x);
  std::vector<at::Tensor> gys;
  for (const at::Tensor& g : grads) gys.push_back(g.contiguous());
  at::Tensor dx = at::zeros_like(x);
  std::vector<at::Tensor> dw, db;
  for (const HeadProjection& p : in.projections) {
    dw.push_back(at::zeros_like(p.weight));
    db.push_back(p.bias ? at::zeros_like(*p.bias) : at::Tensor());
  }
  // dx, dW and db of the slab of x rows `x_rows` whose projection t for rank j got gradient g.
  auto accumulate = [&](const at::Tensor& dx_rows, const at::Tensor& x_rows, const at::Tensor& g,
                        size_t t, int j) {
    dx_rows.addmm_(g, in.rows_of(in.projections[t].weight, t, j));
    in.rows_of(dw[t], t, j).addmm_(g.t(), x_rows);
    if (db[t].defined()) in.rows_of(db[t], t, j).add_(g.sum(0));
  };
  SlabTransfers io(group, x);
  std::vector<Arrival> arrivals;
  for (int k = 1; k < P; ++k) {  // The gradients of the slabs this rank sent.
    const int from = (me + k) % P;
    int tag = kFirstMessage;
    for (const Slab& s : slabs(B, mine, in.per_token(from), limit)) {
      for (size_t t = 0; t < gys.size(); ++t) {
        at::Tensor g = at::empty({s.count, in.range(t, from).size() * in.head_dim(t)}, x.options());
        arrivals.push_back({io.receive(g, from, tag++), g, s, t, from});
      }
    }
  }
  for (int k = 1; k < P; ++k) {  // The gradients of the slabs this rank received.
    const int to = (me + P - k) % P;
    int tag = kFirstMessage;
    for (const Slab& s : slabs(B, sharding.seq.length(to), in.per_token(me), limit)) {
      for (const at::Tensor& g : gys) io.send(rows(g, s, sharding.seq.range(to).begin), to, tag++);
    }
  }
  io.post();
  for (size_t t = 0; t < gys.size(); ++t) {
    for (int64_t b = 0; b < B; ++b) {
      const Slab s{b, 0, mine};
      accumulate(rows(dx, s), rows(x, s), rows(gys[t], s, sharding.seq.range(me).begin), t, me);
    }
  }
  for (Arrival& a : arrivals) {
    io.wait(a.transfer);
    if (a.data.numel() > 0) accumulate(rows(dx, a.slab), rows(x, a.slab), a.data, a.t, a.peer);
  }
  io.finish();
  std::vector<at::Tensor> out{dx};
  out.insert(out.end(), dw.begin(), dw.end());
  for (const at::Tensor& d : db)
    if (d.defined()) out.push_back(d);
  return out;
}

std::vector<at::Tensor> gather_projected_kernel(const at::Tensor& y_in, const at::Tensor& weight,
                                                const Sharding& sharding, const Group& group) {
  const at::Tensor y = y_in.contiguous();
  const int P = group.size(), me = group.rank();
  const auto& ranges = sharding.ranges(Heads::kQuery);
  const int64_t B = y.size(0), D = y.size(3), mine = sharding.seq.length(me);
  const int64_t limit = max_elements(group, y);
  struct {
    at::Tensor out;
    std::vector<at::Tensor> parts;
  } g{at::empty({B, mine, weight.size(0)}, y.options()), std::vector<at::Tensor>(P)};
  g.parts[me] = y.narrow(1, sharding.seq.range(me).begin, mine);
  SlabTransfers io(group, y);
  std::vector<Arrival> arrivals;
  for (int k = 1; k < P; ++k) {
    const int from = (me + P - k) % P;
    g.parts[from] = at::empty({B, mine, ranges[from].size(), D}, y.options());
    int tag = kFirstMessage;
    for (const Slab& s : slabs(B, mine, ranges[from].size() * D, limit)) {
      const at::Tensor dst = rows(g.parts[from], s);
      arrivals.push_back({io.receive(dst, from, tag++), dst, s, 0, from});
    }
  }
  for (int k = 1; k < P; ++k) {
    const int to = (me + k) % P;
    int tag = kFirstMessage;
    for (const Slab& s : slabs(B, sharding.seq.length(to), ranges[me].size() * D, limit)) {
      io.send(rows(y, s, sharding.seq.range(to).begin), to, tag++);
    }
  }
  io.post();
  for (int64_t b = 0; b < B; ++b) {
    const Slab s{b, 0, mine};
    at::Tensor dst = rows(g.out, s);
    at::mm_out(dst, rows(g.parts[me], s), columns(weight, sharding, me, D).t());
  }
  for (Arrival& a : arrivals) {
    io.wait(a.transfer);
    rows(g.out, a.slab).addmm_(a.data, columns(weight, sharding, a.peer, D).t());
  }
  io.finish();
  std::vector<at::Tensor> out{g.out};
  for (int j = 0; j < P; ++j)
    if (j != me) out.push_back(g.parts[j]);
  return out;
}

std::vector<at::Tensor> gather_projected_backward_kernel(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& weight,
    const std::vector<at::Tensor>& peer_parts, const Sharding& sharding, const Group& group) {
  const int P = group.size(), me = group.rank();
  const auto& ranges = sharding.ranges(Heads::kQuery);
  const at::Tensor g = grad.contiguous();
  std::vector<at::Tensor> parts(peer_parts.begin(), peer_parts.end());
  parts.insert(parts.begin() + me,
               y.narrow(1, sharding.seq.range(me).begin, sharding.seq.length(me)));
  const int64_t B = g.size(0), D = parts[me].size(3), mine = sharding.seq.length(me);
  const int64_t limit = max_elements(group, g);
  at::Tensor dy = at::empty({B, sharding.seq.seq_len(), ranges[me].size(), D}, g.options());
  SlabTransfers io(group, g);
  for (int k = 1; k < P; ++k) {  // The gradients of the slabs this rank sent.
    const int from = (me + k) % P;
    int tag = kFirstMessage;
    for (const Slab& s : slabs(B, sharding.seq.length(from), ranges[me].size() * D, limit)) {
      io.receive(rows(dy, s, sharding.seq.range(from).begin), from, tag++);
    }
  }
  for (int k = 1; k < P; ++k) {  // Each peer's, computed slab by slab and sent at once.
    const int to = (me + P - k) % P;
    int tag = kFirstMessage;
    for (const Slab& s : slabs(B, mine, ranges[to].size() * D, limit)) {
      io.send(at::mm(rows(g, s), columns(weight, sharding, to, D)), to, tag++);
    }
  }
  io.post();
  at::Tensor dw = at::zeros_like(weight);
  for (int64_t b = 0; b < B; ++b) {
    const Slab s{b, 0, mine};
    at::Tensor dst = rows(dy, s, sharding.seq.range(me).begin);
    at::mm_out(dst, rows(g, s), columns(weight, sharding, me, D));
    for (int j = 0; j < P; ++j) {
      columns(dw, sharding, j, D).addmm_(rows(g, s).t(), rows(parts[j], s));
    }
  }
  io.finish();
  return {dy, dw};
}

}  // namespace detail

Sharding agree_projection_plan(const Group& group, const HeadPartition& heads, const at::Tensor& x,
                               const std::vector<HeadProjection>& projections,
                               const c10::optional<SequencePartition>& seq) {
  const std::vector<TensorSpec> specs = fail_together_on_error(group, [&] {
    TORCH_CHECK_VALUE(x.defined() && x.dim() == 3,
                      "agree_projection_plan: x must be [B, S_r, E]; got ",
                      x.defined() ? c10::str(x.sizes()) : "undefined");
    const auto dims =
        check_input_projections("agree_projection_plan", x, projections, heads, x.size(1));
    std::vector<TensorSpec> out;
    for (size_t t = 0; t < projections.size(); ++t) {
      const Heads kind = projections[t].heads;
      const int64_t H = kind == Heads::kQuery ? heads.q_heads() : heads.kv_heads();
      out.push_back({x.new_empty({1, 1, 1, 1}).expand({x.size(0), x.size(1), H, dims[t]}), kind,
                     "projection " + std::to_string(t)});
    }
    return out;
  });
  return agree_plan(group, heads, Layout::kBSHD, specs, seq);
}

std::vector<at::Tensor> scatter_projected(const at::Tensor& x,
                                          const std::vector<HeadProjection>& projections,
                                          const Sharding& sharding, const Group& group) {
  detail::check_scatter_projected(x, projections, sharding, group);
  return detail::call_scatter_projected(x, projections, sharding, group);
}

at::Tensor gather_projected(const at::Tensor& y, const at::Tensor& weight, const Sharding& sharding,
                            const Group& group) {
  detail::check_gather_projected(y, weight, sharding, group);
  return detail::call_gather_projected(y, weight, sharding, group);
}

}  // namespace ulysses
