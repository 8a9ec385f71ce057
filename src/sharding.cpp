#include "ulysses/sharding.h"

#include <c10/util/Exception.h>

#include <map>

#include "ulysses/tiled.h"

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
  auto check_like_ids = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(!t.defined() || t.sizes() == ids.sizes(), "shard_batch: ", name, " must be ",
                      ids.sizes(), " like input_ids; got ", t.sizes());
  };
  const at::Tensor labels = global.labels.defined() ? global.labels : ids;
  check_like_ids(labels, "labels");
  check_like_ids(global.attention_mask, "attention_mask");
  TORCH_CHECK_VALUE(!global.position_ids.defined() || global.position_ids.dim() <= 2,
                    "shard_batch: position_ids must be [B, S] or [S]; got ",
                    global.position_ids.sizes());
  at::Tensor targets = at::full({B, S}, ignore_index, labels.options());
  if (S > 1) {
    targets.narrow(1, 0, S - 1).copy_(labels.narrow(1, 1, S - 1));
    if (global.attention_mask.defined()) {
      const at::Tensor pad = global.attention_mask.eq(0);
      const at::Tensor no_target = pad.narrow(1, 1, S - 1).logical_or(pad.narrow(1, 0, S - 1));
      targets.narrow(1, 0, S - 1).masked_fill_(no_target, ignore_index);
    }
  }
  const at::Tensor positions = global.position_ids.defined()
                                   ? global.position_ids.expand({B, S})
                                   : at::arange(S, ids.options()).unsqueeze(0).expand({B, S});
  const at::Tensor i = index.to(ids.device());
  TokenBatch shard{ids.index_select(1, i), targets.index_select(1, i), positions.index_select(1, i),
                   at::Tensor()};
  if (global.attention_mask.defined())
    shard.attention_mask = global.attention_mask.index_select(1, i);
  return shard;
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

namespace {
// The global mean from this rank's differentiable CE sum over `targets`: one all-reduce.
ShardedLoss global_mean(const at::Tensor& local_sum, const at::Tensor& targets, const Group& group,
                        int64_t ignore_index) {
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
}  // namespace

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
  return global_mean(local_sum, targets, group, ignore_index);
}

ShardedLoss sharded_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                         const at::Tensor& targets, const Group& group,
                                         int64_t tiles, int64_t ignore_index) {
  TORCH_CHECK_VALUE(hidden.dim() == 3 && targets.dim() == 2 && hidden.size(0) == targets.size(0) &&
                        hidden.size(1) == targets.size(1),
                    "sharded_linear_cross_entropy: hidden [B, S_r, E] and targets [B, S_r] "
                    "expected; got ",
                    hidden.sizes(), " and ", targets.sizes());
  at::Tensor local_sum = linear_cross_entropy_sum(hidden.reshape({-1, hidden.size(-1)}), weight,
                                                  targets.reshape({-1}), tiles, ignore_index);
  return global_mean(local_sum, targets, group, ignore_index);
}

std::vector<at::Tensor> gradients_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  return grads;
}

void all_reduce_gradients(const std::vector<at::Tensor>& grads, const Group& group) {
  if (group.size() == 1 || grads.empty()) return;
  // One flat buffer per (device, dtype): a collective needs one dtype.
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> buckets;
  for (const at::Tensor& g : grads) buckets[{g.device().str(), g.scalar_type()}].push_back(g);
  for (auto& [key, members] : buckets) {
    std::vector<at::Tensor> flat_parts;
    for (const at::Tensor& g : members) flat_parts.push_back(g.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    group.all_reduce_sum(flat);
    int64_t offset = 0;
    for (at::Tensor g : members) {
      g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  }
}

}  // namespace ulysses
