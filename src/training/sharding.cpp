#include "ulysses/sharding.h"

#include <c10/util/Exception.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <functional>
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
// The global mean from this rank's differentiable CE sum (made by `local_sum`) over `targets`.
// The loss's one collective is an agreement round carrying each rank's sum (its double's bits)
// and count: a rank whose inputs are wrong (a shape, a target outside the vocabulary) fails
// every rank with its error, instead of leaving them waiting in an all-reduce it never posts.
ShardedLoss global_mean(const std::function<at::Tensor()>& local_sum, const at::Tensor& targets,
                        const Group& group, int64_t ignore_index, const char* purpose) {
  at::Tensor sum;
  const auto meta = group.agree(
      [&] {
        sum = local_sum();
        const double value = sum.detach().to(at::kDouble).item<double>();
        const int64_t count = targets.ne(ignore_index).sum().item<int64_t>();
        return std::vector<int64_t>{c10::bit_cast<int64_t>(value), count};
      },
      purpose);
  double global_sum = 0;  // In rank order on every rank: the same value everywhere.
  int64_t count = 0;
  for (const std::vector<int64_t>& m : meta) {
    global_sum += c10::bit_cast<double>(m[0]);
    count += m[1];
  }
  ShardedLoss out;
  out.global_count = count;
  out.global_loss = count > 0 ? global_sum / count : 0.0;
  out.loss = sum / static_cast<double>(std::max<int64_t>(count, 1));
  return out;
}

}  // namespace

ShardedLoss sharded_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                  const Group& group, int64_t ignore_index) {
  return global_mean(
      [&] {
        TORCH_CHECK_VALUE(logits.dim() == 3 && targets.dim() == 2 &&
                              logits.size(0) == targets.size(0) &&
                              logits.size(1) == targets.size(1),
                          "sharded_cross_entropy: logits [B, S_r, V] and targets [B, S_r] "
                          "expected; got ",
                          logits.sizes(), " and ", targets.sizes());
        check_targets(targets, logits.size(2), ignore_index, "sharded_cross_entropy");
        return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                      targets.reshape({-1}), {}, at::Reduction::Sum, ignore_index);
      },
      targets, group, ignore_index, "sharded_cross_entropy");
}

ShardedLoss sharded_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                         const at::Tensor& targets, const Group& group,
                                         int64_t tiles, int64_t ignore_index) {
  return global_mean(
      [&] {
        TORCH_CHECK_VALUE(hidden.dim() == 3 && targets.dim() == 2 &&
                              hidden.size(0) == targets.size(0) &&
                              hidden.size(1) == targets.size(1),
                          "sharded_linear_cross_entropy: hidden [B, S_r, E] and targets [B, S_r] "
                          "expected; got ",
                          hidden.sizes(), " and ", targets.sizes());
        return linear_cross_entropy_sum(hidden.reshape({-1, hidden.size(-1)}), weight,
                                        targets.reshape({-1}), tiles, ignore_index);
      },
      targets, group, ignore_index, "sharded_linear_cross_entropy");
}

ShardedLoss token_mean(const at::Tensor& token_sum, const at::Tensor& targets, const Group& group,
                       int64_t ignore_index) {
  return global_mean(
      [&] {
        TORCH_CHECK_VALUE(token_sum.dim() == 0, "token_mean: token_sum must be a 0-d tensor; got ",
                          token_sum.sizes());
        return token_sum;
      },
      targets, group, ignore_index, "token_mean");
}

std::vector<at::Tensor> gradients_of(const std::vector<at::Tensor>& params, const Group& group) {
  if (group.size() > 1 && !params.empty()) {
    // One flag per parameter, built and read back as plain floats: this runs every step.
    std::vector<float> flags;
    flags.reserve(params.size());
    for (const at::Tensor& p : params) flags.push_back(p.grad().defined() ? 1.0F : 0.0F);
    const auto n = static_cast<int64_t>(flags.size());
    at::Tensor used = at::from_blob(flags.data(), {n}, at::kFloat)
                          .to(params[0].device(), /*non_blocking=*/false, /*copy=*/true);
    group.all_reduce_sum(used);  // (a device-only group's tensors live on the device)
    const at::Tensor anywhere = used.cpu().contiguous();
    const float* const summed = anywhere.data_ptr<float>();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (summed[i] > 0 && !params[i].grad().defined())
        params[i].mutable_grad() = at::zeros_like(params[i]);
    }
  }
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  return grads;
}

void all_reduce_gradients(const std::vector<at::Tensor>& grads, const Group& group,
                          int64_t bucket_bytes) {
  TORCH_CHECK_VALUE(bucket_bytes > 0, "all_reduce_gradients: bucket_bytes must be > 0; got ",
                    bucket_bytes);
  if (group.size() == 1) return;
  struct Bucket {
    std::vector<at::Tensor> members;
    int64_t bytes = 0;
  };
  auto flush = [&](Bucket& bucket) {
    if (bucket.members.size() == 1 && bucket.members[0].is_contiguous()) {
      group.all_reduce_sum(bucket.members[0]);  // in place, no copy
    } else if (!bucket.members.empty()) {
      std::vector<at::Tensor> flat_parts;
      for (const at::Tensor& g : bucket.members) flat_parts.push_back(g.reshape({-1}));
      at::Tensor flat = at::cat(flat_parts);
      group.all_reduce_sum(flat);
      int64_t offset = 0;
      for (at::Tensor& g : bucket.members) {
        g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
        offset += g.numel();
      }
    }
    bucket = Bucket{};
  };
  // One open bucket per (device, dtype): a collective takes one dtype. Every rank walks the same
  // list, so the buckets fill, and their collectives run, in the same order everywhere.
  std::map<std::pair<std::string, at::ScalarType>, Bucket> open;
  for (const at::Tensor& g : grads) {
    Bucket& bucket = open[{g.device().str(), g.scalar_type()}];
    const auto bytes = static_cast<int64_t>(g.nbytes());
    if (bucket.bytes > 0 && bucket.bytes + bytes > bucket_bytes) flush(bucket);
    bucket.members.push_back(g);
    bucket.bytes += bytes;
    if (bucket.bytes >= bucket_bytes) flush(bucket);
  }
  for (auto& [key, bucket] : open) flush(bucket);
}

}  // namespace ulysses
