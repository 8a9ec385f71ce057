// torch.ops.ulysses, the training floor (sharding.h): batch sharding, the exact global
// loss and gradient reduction.
// Every ops file's conventions: Note [Op files] in transport/ops.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "dispatch/op_util.h"
#include "transport/op_options.h"
#include "ulysses/group.h"
#include "ulysses/mesh_plan.h"
#include "ulysses/ring_attention.h"
#include "ulysses/sharding.h"
#include "ulysses/tiled.h"

namespace ulysses {
namespace {

using detail::OptTensor;

// [input ids, targets, position ids] and the padding mask when given, of SP rank `rank` of
// `world` (ring > 1: the hybrid layout's zigzag tokens).
std::vector<at::Tensor> shard_batch_op(const at::Tensor& input_ids, const OptTensor& labels,
                                       const OptTensor& attention_mask,
                                       const OptTensor& position_ids, int64_t rank, int64_t world,
                                       int64_t ring, int64_t ignore_index) {
  check_mesh_sizes(world, world, ring, "shard_batch");
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "shard_batch: need 0 <= rank < world; got rank ",
                    rank, ", world ", world);
  TORCH_CHECK_VALUE(input_ids.dim() == 2, "shard_batch: input_ids must be [B, S]; got ",
                    input_ids.sizes());
  const TokenBatch global{input_ids, labels.value_or(at::Tensor()),
                          position_ids.value_or(at::Tensor()),
                          attention_mask.value_or(at::Tensor())};
  const int64_t S = input_ids.size(1);
  const TokenBatch shard =
      ring == 1 ? shard_batch(global, SequencePartition::even(S, world), rank, ignore_index)
                : shard_batch(global, RingLayout::make(S, world / ring, ring), rank, ignore_index);
  std::vector<at::Tensor> out{shard.input_ids, shard.labels, shard.position_ids};
  if (shard.attention_mask.defined()) out.push_back(shard.attention_mask);
  return out;
}

// (this rank's loss to backpropagate, the global mean as a detached 0-dim tensor).
std::tuple<at::Tensor, at::Tensor> sharded_cross_entropy_op(const at::Tensor& logits,
                                                            const at::Tensor& targets,
                                                            const std::string& group_name,
                                                            c10::IntArrayRef group_options,
                                                            int64_t ignore_index) {
  const ShardedLoss loss =
      sharded_cross_entropy(logits, targets, group_of_op(group_name, group_options), ignore_index);
  return {loss.loss, at::scalar_tensor(loss.global_loss, loss.loss.options())};
}

std::tuple<at::Tensor, at::Tensor> token_mean_op(const at::Tensor& token_sum,
                                                 const at::Tensor& targets,
                                                 const std::string& group_name,
                                                 c10::IntArrayRef group_options,
                                                 int64_t ignore_index) {
  const ShardedLoss loss =
      token_mean(token_sum, targets, group_of_op(group_name, group_options), ignore_index);
  return {loss.loss, at::scalar_tensor(loss.global_loss, loss.loss.options())};
}

at::Tensor linear_cross_entropy_sum_op(const at::Tensor& hidden, const at::Tensor& weight,
                                       const at::Tensor& targets, int64_t tiles,
                                       int64_t ignore_index, const OptTensor& bias, double scale,
                                       double softcap) {
  return linear_cross_entropy_sum(hidden, weight, targets, tiles, ignore_index, bias, scale,
                                  softcap);
}

void all_reduce_gradients_op(at::TensorList grads, const std::string& group_name,
                             c10::IntArrayRef group_options) {
  all_reduce_gradients(grads.vec(), group_of_op(group_name, group_options));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ulysses, m) {
  // Training (sharding.h): a global causal-LM batch's shard for SP rank `rank` of `world`,
  // the exact global mean loss, and gradients summed in place.
  m.def(
      "shard_batch(Tensor input_ids, Tensor? labels, Tensor? attention_mask, "
      "Tensor? position_ids, int rank, int world, int ring=1, int ignore_index=-100) "
      "-> Tensor[]");
  m.def(
      "sharded_cross_entropy(Tensor logits, Tensor targets, str group, int[] group_options, "
      "int ignore_index=-100) -> (Tensor, Tensor)");
  m.def(
      "token_mean(Tensor token_sum, Tensor targets, str group, int[] group_options, "
      "int ignore_index=-100) -> (Tensor, Tensor)");
  m.def("all_reduce_gradients(Tensor(a!)[] grads, str group, int[] group_options) -> ()");
  // Tiled linear cross-entropy (tiled.h): the summed loss of hidden [N, E] through weight [V, E]
  // against targets [N], `tiles` row tiles at a time; its own backward (eager only).
  m.def(
      "linear_cross_entropy_sum(Tensor hidden, Tensor weight, Tensor targets, int tiles, "
      "int ignore_index=-100, Tensor? bias=None, float scale=1., float softcap=0.) -> Tensor");
}

TORCH_LIBRARY_IMPL(ulysses, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_gradients", &all_reduce_gradients_op);
}

TORCH_LIBRARY_IMPL(ulysses, CompositeImplicitAutograd, m) {
  m.impl("shard_batch", &shard_batch_op);
  m.impl("sharded_cross_entropy", &sharded_cross_entropy_op);
  m.impl("token_mean", &token_mean_op);
  m.impl("linear_cross_entropy_sum", &linear_cross_entropy_sum_op);
}

}  // namespace ulysses
