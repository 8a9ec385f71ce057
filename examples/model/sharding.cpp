#include "sharding.h"

#include <c10/util/Exception.h>

namespace ulysses {

namespace {
// The tokens `index` of the global batch, with next-token targets made before the cut.
TokenBatch take_tokens(const TokenBatch& global, int64_t seq_len, const at::Tensor& index,
                       int64_t ignore_index) {
  const at::Tensor& ids = global.input_ids;
  TORCH_CHECK_VALUE(ids.dim() == 2, "shard_batch: input_ids must be [B, S]; got ", ids.sizes());
  const int64_t B = ids.size(0), S = ids.size(1);
  TORCH_CHECK_VALUE(seq_len == S, "shard_batch: the sequence split covers ", seq_len,
                    " tokens but the batch has ", S);
  at::Tensor labels = global.labels.defined() ? global.labels : ids;
  TORCH_CHECK_VALUE(labels.sizes() == ids.sizes(), "shard_batch: labels must be ", ids.sizes(),
                    "; got ", labels.sizes());
  at::Tensor targets = at::full({B, S}, ignore_index, labels.options());
  if (S > 1) targets.narrow(1, 0, S - 1).copy_(labels.narrow(1, 1, S - 1));
  at::Tensor positions = global.position_ids.defined()
                             ? global.position_ids.expand({B, S})
                             : at::arange(S, ids.options()).unsqueeze(0).expand({B, S});
  const at::Tensor i = index.to(ids.device());
  return {ids.index_select(1, i), targets.index_select(1, i), positions.index_select(1, i)};
}
}  // namespace

TokenBatch shard_batch(const TokenBatch& global, const SequencePartition& seq, int64_t rank,
                       int64_t ignore_index) {
  const Range r = seq.range(rank);
  return take_tokens(global, seq.seq_len(), at::arange(r.begin, r.end, at::kLong), ignore_index);
}

TokenBatch shard_batch(const TokenBatch& global, const RingLayout& layout, int64_t rank,
                       int64_t ignore_index) {
  return take_tokens(global, layout.seq_len(), layout.shard_index(rank), ignore_index);
}

ShardedLoss sharded_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                  const Group& group, int64_t ignore_index) {
  TORCH_CHECK_VALUE(logits.dim() == 3 && targets.dim() == 2 && logits.size(0) == targets.size(0) &&
                        logits.size(1) == targets.size(1),
                    "sharded_cross_entropy: logits [B, S_r, V] and targets [B, S_r] expected; "
                    "got ",
                    logits.sizes(), " and ", targets.sizes());
  at::Tensor local_sum =
      at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                             targets.reshape({-1}), {}, at::Reduction::Sum, ignore_index);
  at::Tensor totals = at::stack(
      {local_sum.detach().to(at::kDouble), targets.ne(ignore_index).sum().to(at::kDouble)});
  group.all_reduce_sum(totals);
  const double global_sum = totals[0].item<double>();
  const auto count = static_cast<int64_t>(totals[1].item<double>());
  ShardedLoss out;
  out.global_count = count;
  out.global_loss = count > 0 ? global_sum / count : 0.0;
  out.loss = local_sum / static_cast<double>(std::max<int64_t>(count, 1));
  return out;
}

void all_reduce_gradients(const std::vector<at::Tensor>& params, const Group& group) {
  if (group.size() == 1) return;
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  std::vector<at::Tensor> flat_parts;
  for (const at::Tensor& g : grads) flat_parts.push_back(g.reshape({-1}));
  at::Tensor flat = at::cat(flat_parts);
  group.all_reduce_sum(flat);
  int64_t offset = 0;
  for (at::Tensor g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

}  // namespace ulysses
