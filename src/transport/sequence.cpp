// Sequence collectives: all_gather_sequence and its adjoint reduce_scatter_sequence.
#include <c10/util/Exception.h>

#include <string>

#include "plan/fnv1a.h"
#include "transport/ops.h"
#include "transport/wire.h"
#include "ulysses/all_to_all.h"

namespace ulysses {
namespace {

at::Tensor gather_impl(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                       const Group& group) {
  const int P = group.size();
  int64_t s_max = 0;
  for (int64_t n : seq.lengths()) s_max = std::max(s_max, n);
  // Gloo's all-gather needs equal sizes: pad every shard to the longest.
  at::Tensor front = x.movedim(dim, 0);
  std::vector<int64_t> padded_shape = front.sizes().vec();
  padded_shape[0] = s_max;
  at::Tensor padded = at::zeros(padded_shape, x.options());
  padded.narrow(0, 0, front.size(0)).copy_(front);
  at::Tensor all = group.all_gather(detail::wire_view(padded)).view(x.scalar_type());
  std::vector<at::Tensor> parts;
  for (int r = 0; r < P; ++r) parts.push_back(all[r].narrow(0, 0, seq.length(r)));
  return at::cat(parts, 0).movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter_impl(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group) {
  const int P = group.size(), me = group.rank();
  at::Tensor front = x.movedim(dim, 0).contiguous();  // [S, rest...]: rank blocks contiguous.
  const int64_t rest = c10::multiply_integers(front.sizes().slice(1));
  std::vector<int64_t> send_splits, recv_splits;
  for (int r = 0; r < P; ++r) {
    send_splits.push_back(seq.length(r) * rest);
    recv_splits.push_back(seq.length(me) * rest);
  }
  at::Tensor send = front.view({-1});
  at::Tensor recv = at::empty({P * seq.length(me) * rest}, x.options());
  group.all_to_all(recv, send, recv_splits, send_splits);
  std::vector<int64_t> shape = front.sizes().vec();
  shape[0] = seq.length(me);
  shape.insert(shape.begin(), P);
  return recv.view(shape).sum(0).movedim(0, dim).contiguous();
}

int64_t wrap_dim(int64_t dim, int64_t ndim) { return dim < 0 ? dim + ndim : dim; }

// Checks `x` on every rank before a sequence collective along `dim` moves its bytes: the
// sequence dim holds this rank's tokens of `seq`, and every rank has the same split, number of
// dims, dtype and elements per token (so Gloo never sees mismatched sizes). Returns the
// wrapped dim.
int64_t agree_sequence_tensor(const char* op, const at::Tensor& x, int64_t dim,
                              const SequencePartition& seq, bool gather, const Group& group) {
  int64_t d = 0;
  auto all = group.agree(
      [&] {
        TORCH_CHECK_INDEX(x.dim() > 0 && dim >= -x.dim() && dim < x.dim(), op, ": dim ", dim,
                          " is out of range for shape ", x.sizes());
        d = wrap_dim(dim, x.dim());
        TORCH_CHECK_VALUE(static_cast<int>(seq.lengths().size()) == group.size(), op,
                          ": seq_lens must give one length per rank (", group.size(), "); got ",
                          seq.lengths().size());
        const int64_t tokens = gather ? seq.length(group.rank()) : seq.seq_len();
        TORCH_CHECK_VALUE(x.size(d) == tokens, op, ": dim ", d, " of shape ", x.sizes(),
                          " must hold ", tokens, " tokens");
        int64_t per_token =
            1;  // From the shape: an empty shard (S_r = 0) has elements per token too.
        for (int64_t i = 0; i < x.dim(); ++i) per_token *= i == d ? 1 : x.size(i);
        const int64_t split = Fnv1a().add(seq.lengths()).non_negative();
        return std::vector<int64_t>{x.dim(), static_cast<int64_t>(x.scalar_type()), d, per_token,
                                    split};
      },
      std::string("the sequence tensor (") + op + ")");
  const char* what[] = {"number of dims", "dtype (as c10::ScalarType)", "sequence dim",
                        "elements per token", "sequence split (seq_lens; as its FNV-1a hash)"};
  for (size_t r = 0; r < all.size(); ++r) {
    for (size_t i = 0; i < 5; ++i) {
      TORCH_CHECK_VALUE(all[r][i] == all[0][i], op, ": ranks disagree on the tensor's ", what[i],
                        ": rank 0 has ", all[0][i], ", rank ", r, " has ", all[r][i]);
    }
  }
  return d;
}

}  // namespace

namespace detail {

at::Tensor sequence_collective_kernel(const at::Tensor& x, int64_t dim,
                                      const SequencePartition& seq, const Group& group,
                                      SequenceCollective which, ShapeAgreement shapes) {
  if (group.size() == 1) return x;
  const bool gather = which == SequenceCollective::kAllGather;
  const char* op = gather ? "all_gather_sequence" : "reduce_scatter_sequence";
  dim = shapes == ShapeAgreement::kAgree ? agree_sequence_tensor(op, x, dim, seq, gather, group)
                                         : wrap_dim(dim, x.dim());
  at::NoGradGuard no_grad;
  return gather ? gather_impl(x, dim, seq, group) : reduce_scatter_impl(x, dim, seq, group);
}

}  // namespace detail

at::Tensor all_gather_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                               const Group& group) {
  if (group.size() == 1) return x;
  return detail::call_sequence_collective(x, dim, seq, group,
                                          detail::SequenceCollective::kAllGather);
}

at::Tensor reduce_scatter_sequence(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                   const Group& group) {
  if (group.size() == 1) return x;
  return detail::call_sequence_collective(x, dim, seq, group,
                                          detail::SequenceCollective::kReduceScatter);
}

}  // namespace ulysses
