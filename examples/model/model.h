// A small decoder-only GQA transformer whose attention is sequence-parallel.
//
// Each rank holds a shard x[B, S_r] of every sequence; every layer but attention is token-local:
//   h = embed(x);  per layer: h += Wo * attn(rope(Wq n(h)), rope(Wk n(h)), Wv n(h));
//                             h += W2 (silu(W1 n(h)) * W3 n(h));
//   logits = n(h) * embed^T   (tied LM head; n = RMSNorm).
// Rotary angles come from global position ids, so sharding never changes them.
// For long sequences (tiled.h) the MLP and the loss run in sequence tiles and each block can be
// checkpointed; the results are the same, the memory smaller.
#pragma once

#include <torch/torch.h>

#include "ulysses/distributed_attention.h"
#include "ulysses/group.h"
#include "ulysses/sharding.h"
#include "ulysses/tiled.h"

namespace ulysses {

// Size of the model. Defaults make a model that trains in seconds on two cores.
struct ModelConfig {
  int64_t vocab = 256;  // Token ids in [0, vocab).
  int64_t dim = 64;     // Model width; divisible by q_heads, head dim even.
  int64_t layers = 2;
  int64_t q_heads = 4;          // Hq.
  int64_t kv_heads = 2;         // Hkv; divides q_heads.
  int64_t ffn_dim = 0;          // SwiGLU hidden width; 0 means 8/3 * dim rounded up to 16.
  double rope_theta = 10000;    // Rotary base.
  double norm_eps = 1e-5;       // RMSNorm epsilon.
  bool packed = false;          // Pass position ids to attention (documents restart at 0).
  bool tiled = false;           // Run the MLP and the loss in sequence tiles (tiled.h).
  int64_t mlp_tile_tokens = 0;  // Tokens per MLP tile (>= 1); 0: dim.
  int64_t loss_tile_bytes = kLossTileBytes;   // fp32 logits one loss tile may hold (>= 1).
  Checkpoint checkpoint = Checkpoint::kNone;  // How each block keeps its input for backward.
  LocalKernel local = LocalKernel::kAuto;     // Each rank's local attention kernel.
  int64_t head_dim() const { return dim / q_heads; }
  int64_t hidden() const { return ffn_dim > 0 ? ffn_dim : (8 * dim / 3 + 15) / 16 * 16; }
};

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);

 private:
  at::Tensor weight_;  // [dim], ones at init.
  double eps_;
};
TORCH_MODULE(RMSNorm);

// [B, S_r, H, D] -> the same, rotated by angles positions * theta^(-2i/D) (rotate-half form).
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& positions, double theta);

class BlockImpl : public torch::nn::Module {
 public:
  // sp_group: the Ulysses group; ring_group: the ring group of a hybrid layout (solo: none).
  BlockImpl(const ModelConfig& config, const Group& sp_group, const Group& ring_group);
  // x: [B, S_r, dim]; positions: [B, S_r] global position ids; mlp_tiles (>= 1): the MLP's
  // sequence tiles (1: untiled).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, StepContext* context,
                     int64_t mlp_tiles = 1);

 private:
  at::Tensor mlp(const at::Tensor& y);  // W2 (silu(W1 n(y)) * W3 n(y)), position-wise.

  ModelConfig config_;
  RMSNorm attn_norm_{nullptr}, mlp_norm_{nullptr};
  torch::nn::Linear wq_{nullptr}, wk_{nullptr}, wv_{nullptr}, wo_{nullptr};
  torch::nn::Linear w1_{nullptr}, w2_{nullptr}, w3_{nullptr};
  DistributedAttention attention_;  // Causal; this block's head partition.
};
TORCH_MODULE(Block);

class TransformerImpl : public torch::nn::Module {
 public:
  // Parameters are drawn from N(0, 0.02) with a generator seeded by `seed` (norms start at 1),
  // so every rank builds the same model without touching global RNG state.
  // With a ring group (R > 1), sp_group is the Ulysses group and inputs follow RingLayout.
  TransformerImpl(const ModelConfig& config, const Group& sp_group, uint64_t seed,
                  const Group& ring_group = Group::solo());
  // tokens, positions: [B, S_r] (int64) -> logits [B, S_r, vocab].
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions,
                     StepContext* context = nullptr);
  // The final normalised hidden states [B, S_r, dim]. longest_shard: the rows of the group's
  // largest shard (every rank gives the same; 0: this shard's), from which tile counts follow.
  at::Tensor hidden(const at::Tensor& tokens, const at::Tensor& positions, StepContext* context,
                    int64_t longest_shard = 0);
  // The shard's share of the exact global mean next-token loss over `group` (sharding.h):
  // the logits in tiles with config().tiled, else whole.
  ShardedLoss loss(const TokenBatch& shard, const Group& group, StepContext* context,
                   int64_t longest_shard = 0);
  const ModelConfig& config() const { return config_; }

 private:
  ModelConfig config_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList blocks_;
  RMSNorm norm_{nullptr};
};
TORCH_MODULE(Transformer);

}  // namespace ulysses
