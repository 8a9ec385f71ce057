// Long sequences past attention: compute traded for memory, with the same results.
//
// tiled_map(f, x, T):          y[:, t] = f(x[:, t]) for T tiles t of dim 1 (f position-wise).
//                              Forward keeps only x; backward recomputes one tile at a time and
//                              writes each tile's input gradient into its slice of one buffer.
// linear_cross_entropy_sum:    sum_i [lse_i - z_i,y_i] over rows with y_i != ignore_index, where
//                              z = c tanh(s (hidden weight^T + bias) / c) (the scale s and the
//                              softcap c optional), lse_i = logsumexp_j z_i,j. Forward keeps the
//                              [N] lse only; backward recomputes one tile of z at a time, so the
//                              [N, V] logits never exist.
// checkpoint(f, x):            f(x), keeping only x (optionally moved to host memory) and
//                              recomputing f in backward.
//
// Each returns the gradients of x and of the declared `params` through its own autograd node,
// once per parameter per call (what a gradient-reducing hook expects). f must be deterministic
// given the CPU generator's state, which checkpoint replays; it may run collectives, provided
// every rank of their group runs the same calls (the recompute repeats them in backward).
// Python's ulysses.tiled runs linear_cross_entropy_sum through its op, and has its own tiled map
// and checkpoint for Python functions (the same algorithms over Python callables).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <functional>
#include <string>
#include <vector>

namespace ulysses {

// A function of one tensor that holds its own parameters (a layer, an MLP).
using TensorFunction = std::function<at::Tensor(const at::Tensor&)>;

// How a checkpointed layer keeps its input for backward.
enum class Checkpoint {
  kNone,       // Not checkpointed: autograd saves what each op needs.
  kRecompute,  // Keep the input; recompute the layer in backward.
  kOffload,    // As kRecompute, with the input moved to host memory by a background copy.
};
// "none", "recompute" or "offload"; parse_checkpoint raises c10::ValueError on any other text.
std::string to_string(Checkpoint mode);
Checkpoint parse_checkpoint(const std::string& name);

// The fp32 logits one tile of a tiled loss holds by default: 16 MiB.
constexpr int64_t kLossTileBytes = int64_t{16} << 20;
// The tiles of a tiled loss over `rows` rows of `vocab` classes, each holding at most
// `tile_bytes` (>= 1) of fp32 logits (at least one row a tile): the one rule, from the agreed
// sizes alone, so every rank cuts alike.
int64_t loss_tile_count(int64_t rows, int64_t vocab, int64_t tile_bytes = kLossTileBytes);

// The number of tiles of at most `tile_rows` (>= 1) rows that cover `rows` (>= 0) rows; at
// least 1. Every rank derives it from the same agreed sizes, so no collective is needed.
int64_t tile_count(int64_t rows, int64_t tile_rows);

// f applied to `tiles` (>= 1) slices of x along `dim` (tiles > x.size(dim) leaves some empty).
// f must map [.., n, ..] to [.., n, ..] along `dim` and read no other slice (an MLP on
// [B, S, E]). `params`: the parameters f reads, which receive gradients.
at::Tensor tiled_map(const TensorFunction& f, const at::Tensor& x, int64_t tiles,
                     const std::vector<at::Tensor>& params, int64_t dim = 1);

// The summed cross-entropy of hidden [N, E] through weight [V, E] (and bias [V]) against targets
// [N] (int64), a 0-d fp32 tensor; rows whose target is ignore_index add nothing. Logits are
// computed in fp32, `tiles` (>= 1) row tiles at a time, then multiplied by `scale` and capped
// by `softcap` (> 0: c * tanh(z / c), Gemma's final softcap), in that order; the weight's and
// bias's gradients accumulate in fp32.
at::Tensor linear_cross_entropy_sum(const at::Tensor& hidden, const at::Tensor& weight,
                                    const at::Tensor& targets, int64_t tiles,
                                    int64_t ignore_index = -100,
                                    const c10::optional<at::Tensor>& bias = c10::nullopt,
                                    double scale = 1.0, double softcap = 0.0);

// The label rule: what is wrong with `targets` (called `name` in the message, prefixed by
// `who`) for a loss over `vocab` classes, or "": they must be int64, each in [0, vocab) or
// ignore_index. Python's tiled loss reads it through _C, to fail together with other ranks.
std::string target_problem(const at::Tensor& targets, int64_t vocab, int64_t ignore_index,
                           const std::string& who, const std::string& name);
// Raises target_problem's message (naming `who`): c10::TypeError for the dtype, else
// c10::ValueError.
void check_targets(const at::Tensor& targets, int64_t vocab, int64_t ignore_index, const char* who);

// f(x) as one autograd node that keeps x and recomputes f in backward (kRecompute), or keeps a
// host copy of x made in the background (kOffload; on a CPU tensor, a copy into other host
// memory by a worker thread, waited for in backward). kNone, grad mode off, or nothing
// requiring a gradient: f(x) as it is.
at::Tensor checkpoint(const TensorFunction& f, const at::Tensor& x,
                      const std::vector<at::Tensor>& params, Checkpoint mode);

}  // namespace ulysses
