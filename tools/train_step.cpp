#include "train_step.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <string>

namespace ulysses::cli {

int64_t longest_shard(const RingLayout& seq) {
  int64_t rows = 0;
  for (int64_t p = 0; p < seq.sp_size(); ++p) rows = std::max(rows, seq.shard_index(p).numel());
  return rows;
}

ShardedLoss forward_backward(Transformer& model, const TokenBatch& shard, const Mesh& mesh,
                             int64_t longest) {
  StepContext context(mesh.ulysses);
  ShardedLoss loss = model->loss(shard, mesh.world, &context, longest);
  loss.loss.backward();
  all_reduce_gradients(gradients_of(model->parameters(), mesh.world), mesh.world);
  return loss;
}

int run_check(Transformer& model, const TrainOptions& o, const Data& data, const Mesh& mesh,
              const RingLayout& seq) {
  const int dp = mesh.dp.size();
  const TokenBatch local = data.batch(0, 0, mesh.dp.rank() * o.batch, o.batch);
  model->zero_grad();
  const ShardedLoss ours =
      forward_backward(model, shard_batch(local, seq, mesh.sp.rank()), mesh, longest_shard(seq));

  Group solo = Group::solo();
  ModelConfig plain = o.model;  // The reference holds every activation: no tiles, no recompute.
  plain.tiled = false;
  plain.checkpoint = Checkpoint::kNone;
  Transformer reference(plain, solo, o.seed);
  const TokenBatch global = data.batch(0, 0, 0, o.batch * dp);
  const TokenBatch whole = shard_batch(global, SequencePartition::even(o.seq_len, 1), 0);
  at::Tensor logits = reference->forward(whole.input_ids, whole.position_ids);
  ShardedLoss ref = sharded_cross_entropy(logits, whole.labels, solo);
  ref.loss.backward();

  double worst = std::abs(ours.global_loss - ref.global_loss) / std::abs(ref.global_loss);
  std::string worst_name = "loss";
  auto ref_params = reference->named_parameters();
  for (const auto& p : model->named_parameters()) {
    const at::Tensor& g = p.value().grad();
    const at::Tensor& r = ref_params[p.key()].grad();
    const double err = (g - r).abs().max().item<double>() / r.abs().max().item<double>();
    if (err > worst) worst = err, worst_name = p.key();
  }
  at::Tensor w = at::tensor({worst}, at::kDouble);
  at::Tensor all = mesh.world.all_gather(w);
  const double max_err = all.max().item<double>();
  const bool pass = max_err <= 1e-4;
  if (mesh.world.rank() == 0) {
    std::cout << std::setprecision(6) << "check: world " << mesh.world.size() << " (sp "
              << mesh.sp.size() << " x dp " << dp << "), seq_len " << o.seq_len << " "
              << describe(seq) << memory_line(o.model) << "\n"
              << "check: loss " << ours.global_loss << " vs single-rank " << ref.global_loss << "\n"
              << "check: max relative error over loss and " << model->parameters().size()
              << " gradients: " << std::scientific << max_err << " (rank 0 worst: " << worst_name
              << ")\n"
              << (pass ? "PASS" : "FAIL") << std::endl;
  }
  return pass ? 0 : 1;
}

double evaluate(Transformer& model, const TrainOptions& o, const Data& data, const Mesh& mesh,
                const RingLayout& seq, int64_t step) {
  torch::NoGradGuard no_grad;
  const int64_t per_replica = std::max<int64_t>(1, o.eval_sequences / mesh.dp.size());
  at::Tensor counts = at::zeros({2}, at::kDouble);
  for (int64_t i = 0; i < per_replica; i += o.batch) {
    const int64_t n = std::min(o.batch, per_replica - i);
    TokenBatch shard =
        shard_batch(data.batch(1, step, mesh.dp.rank() * per_replica + i, n), seq, mesh.sp.rank());
    StepContext context(mesh.ulysses);
    at::Tensor pred = model->forward(shard.input_ids, shard.position_ids, &context).argmax(-1);
    at::Tensor scored = shard.labels.ne(kIgnoreIndex);
    counts[0] += pred.eq(shard.labels).logical_and(scored).sum().item<double>();
    counts[1] += scored.sum().item<double>();
  }
  mesh.world.all_reduce_sum(counts);
  return counts[1].item<double>() > 0 ? counts[0].item<double>() / counts[1].item<double>() : 0;
}

}  // namespace ulysses::cli
