#include "model.h"

#include <ATen/CPUGeneratorImpl.h>

namespace ulysses {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight_ = register_parameter("weight", torch::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, true) + eps_) * weight_;
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& positions, double theta) {
  const int64_t D = x.size(-1), half = D / 2;
  TORCH_CHECK_VALUE(D % 2 == 0, "apply_rotary: head dim must be even; got ", D);
  at::Tensor inv_freq =
      at::pow(theta, -at::arange(0, half, x.options().dtype(at::kDouble)) * 2.0 / D);
  at::Tensor angles = positions.to(at::kDouble).unsqueeze(-1) * inv_freq;  // [B, S_r, D/2]
  at::Tensor cos = angles.cos().to(x.scalar_type()).unsqueeze(2);          // [B, S_r, 1, D/2]
  at::Tensor sin = angles.sin().to(x.scalar_type()).unsqueeze(2);
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x1 * sin + x2 * cos}, -1);
}

BlockImpl::BlockImpl(const ModelConfig& c, const Group& sp_group, const Group& ring_group)
    : config_(c), attention_(sp_group, ring_group, [&] {
        AttentionOptions o;
        o.q_heads = c.q_heads;
        o.kv_heads = c.kv_heads;
        o.causal = true;
        o.kernel = c.local;
        return o;
      }()) {
  const int64_t D = c.head_dim();
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  attn_norm_ = register_module("attn_norm", RMSNorm(c.dim, c.norm_eps));
  wq_ = register_module("wq", linear(c.dim, c.q_heads * D));
  wk_ = register_module("wk", linear(c.dim, c.kv_heads * D));
  wv_ = register_module("wv", linear(c.dim, c.kv_heads * D));
  wo_ = register_module("wo", linear(c.q_heads * D, c.dim));
  mlp_norm_ = register_module("mlp_norm", RMSNorm(c.dim, c.norm_eps));
  w1_ = register_module("w1", linear(c.dim, c.hidden()));
  w2_ = register_module("w2", linear(c.hidden(), c.dim));
  w3_ = register_module("w3", linear(c.dim, c.hidden()));
}

at::Tensor BlockImpl::mlp(const at::Tensor& y) {
  at::Tensor m = mlp_norm_(y);
  return w2_(torch::silu(w1_(m)) * w3_(m));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const at::Tensor& positions,
                              StepContext* context, int64_t mlp_tiles) {
  // q, k, v are projected per destination rank (head parts): each GEMM's output is the message
  // to its rank, and o's parts go through wo as they arrive, so nothing is packed or unpacked.
  const HeadPartition& heads = *attention_.partition();
  at::Tensor h = attn_norm_(x);
  auto rotated = [&](std::vector<at::Tensor> parts) {
    for (at::Tensor& p : parts) p = apply_rotary(p, positions, config_.rope_theta);
    return parts;
  };
  const auto q = rotated(project_head_parts(h, wq_->weight, {}, heads.q_ranges()));
  const auto k = rotated(project_head_parts(h, wk_->weight, {}, heads.kv_ranges()));
  const auto v = project_head_parts(h, wv_->weight, {}, heads.kv_ranges());
  AttentionInputs in;
  in.context = context;
  if (config_.packed) in.positions = positions;
  const auto o = attention_.forward_parts(q, k, v, in);
  at::Tensor y = x + project_from_head_parts(o, wo_->weight, heads.q_ranges());
  if (mlp_tiles == 1) return y + mlp(y);
  std::vector<at::Tensor> params = mlp_norm_->parameters();
  for (const torch::nn::Linear* w : {&w1_, &w2_, &w3_}) params.push_back((*w)->weight);
  return y + tiled_map([this](const at::Tensor& t) { return mlp(t); }, y, mlp_tiles, params);
}

TransformerImpl::TransformerImpl(const ModelConfig& c, const Group& sp_group, uint64_t seed,
                                 const Group& ring_group)
    : config_(c) {
  TORCH_CHECK_VALUE(c.dim % c.q_heads == 0 && c.head_dim() % 2 == 0, "Transformer: dim (", c.dim,
                    ") must split into ", c.q_heads, " heads of an even size");
  embed_ = register_module("embed", torch::nn::Embedding(c.vocab, c.dim));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) blocks_->push_back(Block(c, sp_group, ring_group));
  norm_ = register_module("norm", RMSNorm(c.dim, c.norm_eps));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    if (p.key().find("norm") == std::string::npos) p.value().normal_(0.0, 0.02, gen);
  }
}

at::Tensor TransformerImpl::hidden(const at::Tensor& tokens, const at::Tensor& positions,
                                   StepContext* context, int64_t longest_shard) {
  const int64_t rows = longest_shard > 0 ? longest_shard : tokens.size(1);
  // ~dim tokens per MLP tile (DeepSpeed ALST's choice): the [tile, hidden] intermediate stays
  // near the size of the layer's [B, S_r, dim] input.
  const int64_t tile_tokens = config_.mlp_tile_tokens > 0 ? config_.mlp_tile_tokens : config_.dim;
  const int64_t mlp_tiles =
      config_.tiled ? std::min(rows, tile_count(tokens.size(0) * rows, tile_tokens)) : 1;
  at::Tensor h = embed_(tokens);
  for (const auto& module : *blocks_) {
    BlockImpl* block = module->as<Block>();
    h = checkpoint(
        [block, positions, context, mlp_tiles](const at::Tensor& x) {
          return block->forward(x, positions, context, mlp_tiles);
        },
        h, block->parameters(), config_.checkpoint);
  }
  return norm_(h);
}

at::Tensor TransformerImpl::forward(const at::Tensor& tokens, const at::Tensor& positions,
                                    StepContext* context) {
  return at::matmul(hidden(tokens, positions, context), embed_->weight.t());
}

ShardedLoss TransformerImpl::loss(const TokenBatch& shard, const Group& group, StepContext* context,
                                  int64_t longest_shard) {
  at::Tensor h = hidden(shard.input_ids, shard.position_ids, context, longest_shard);
  if (!config_.tiled) {
    return sharded_cross_entropy(at::matmul(h, embed_->weight.t()), shard.labels, group);
  }
  const int64_t rows = longest_shard > 0 ? longest_shard : h.size(1);
  const int64_t tiles = loss_tile_count(h.size(0) * rows, config_.vocab, config_.loss_tile_bytes);
  return sharded_linear_cross_entropy(h, embed_->weight, shard.labels, group, tiles);
}

}  // namespace ulysses
