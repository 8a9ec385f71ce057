// The transport floor's dispatcher ops (registered in transport/ops.cpp): the library's calls
// into them, and the kernels they run.
//
// Note [One autograd]: every differentiable step of the library is a dispatcher op whose
// autograd kernel (each floor's ops.cpp) records the backward, the adjoint op. The C++ API
// functions (scatter_heads, rebuild_mask, flash_attention, ...) call these ops, as Python does,
// so one formula serves both, and torch.compile traces every step through the ops' fake
// kernels. The kernels below run without autograd.
//
// Note [Op files]: each floor registers its ops in its own ops.cpp, alike. Each op takes its
// process group as the torch.distributed group name (a string, as torch's functional
// collectives do) and the group handle's options as integers (transport/op_options.h), so
// torch.compile can trace calls to it. Kernels run without autograd and return outputs that
// never alias their inputs (a dispatcher op contract); the autograd kernels run the kernel below
// autograd and record the adjoint op as the backward (Note [One autograd]). Fake kernels live in
// python/ulysses/fake_kernels.py.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

#include "transport/agreement.h"
#include "ulysses/all_to_all.h"
#include "ulysses/group.h"
#include "ulysses/partition.h"

namespace ulysses {

// How a call holds its tensors: whole, or as head parts (one tensor per rank of the group).
enum class HeadForm { kWhole, kParts };

namespace detail {

// Which sequence collective: all_gather_sequence, or its adjoint reduce_scatter_sequence.
enum class SequenceCollective { kAllGather, kReduceScatter };
// Whether a collective first agrees on its shapes with the other ranks, or they are agreed
// already (a backward, whose gradient is shaped like the agreed forward).
enum class ShapeAgreement { kAgree, kAgreed };

// The sharding an op's arguments describe (seq_lens: one entry per rank of a group of sp_size).
Sharding sharding_of(int64_t q_heads, int64_t kv_heads, c10::IntArrayRef seq_lens,
                     const std::string& layout, int64_t sp_size);

// ---- op calls (with autograd) ----
std::vector<at::Tensor> call_scatter_heads(const std::vector<at::Tensor>& xs,
                                           const std::vector<Heads>& tensor_heads,
                                           const Sharding& sharding, const Group& group);
std::vector<at::Tensor> call_scatter_head_parts(const std::vector<std::vector<at::Tensor>>& parts,
                                                const std::vector<Heads>& tensor_heads,
                                                const Sharding& sharding, const Group& group);
// scatter_heads (or scatter_head_parts of qkv[t]'s parts) whose op agrees on the call first:
// the attention path whose every collective runs inside an op.
std::vector<at::Tensor> call_scatter_agreed(const std::vector<std::vector<at::Tensor>>& qkv,
                                            HeadForm form, const std::vector<Heads>& tensor_heads,
                                            int64_t q_heads, int64_t kv_heads,
                                            const SequencePartition& seq, Layout layout,
                                            const Group& group, const CallOptions& options);
// gather_heads, or for HeadForm::kParts gather_head_parts (tensor t's part j at t * P + j).
std::vector<at::Tensor> call_gather_heads(const std::vector<at::Tensor>& ys,
                                          const std::vector<Heads>& tensor_heads,
                                          const Sharding& sharding, const Group& group,
                                          HeadForm form);
at::Tensor call_sequence_collective(const at::Tensor& x, int64_t dim, const SequencePartition& seq,
                                    const Group& group, SequenceCollective which,
                                    ShapeAgreement shapes = ShapeAgreement::kAgree);
// scatter_projected and gather_projected on an agreed sharding.
std::vector<at::Tensor> call_scatter_projected(const at::Tensor& x,
                                               const std::vector<HeadProjection>& projections,
                                               const Sharding& sharding, const Group& group);
at::Tensor call_gather_projected(const at::Tensor& y, const at::Tensor& weight,
                                 const Sharding& sharding, const Group& group);

// ---- kernels (no autograd) ----
// This rank's checks of scatter_projected's and gather_projected's arguments against `sharding`.
void check_scatter_projected(const at::Tensor& x, const std::vector<HeadProjection>& projections,
                             const Sharding& sharding, const Group& group);
void check_gather_projected(const at::Tensor& y, const at::Tensor& weight, const Sharding& sharding,
                            const Group& group);
// scatter_projected's outputs y_t [B, S, |R_t[r]|, D_t].
std::vector<at::Tensor> scatter_projected_kernel(const at::Tensor& x,
                                                 const std::vector<HeadProjection>& projections,
                                                 const Sharding& sharding, const Group& group);
// Its gradients: {dx, dW_t for each t, db_t for each t with a bias}.
std::vector<at::Tensor> scatter_projected_backward_kernel(
    const std::vector<at::Tensor>& grads, const at::Tensor& x,
    const std::vector<HeadProjection>& projections, const Sharding& sharding, const Group& group);
// gather_projected's output [B, S_r, E], then the blocks it multiplied from each peer j != r
// in rank order (rank j's heads on this rank's tokens, [B, S_r, |R[j]|, D]): backward's dW
// needs them.
std::vector<at::Tensor> gather_projected_kernel(const at::Tensor& y, const at::Tensor& weight,
                                                const Sharding& sharding, const Group& group);
// Its gradients {dy, dW}, from the peers' blocks the forward returned.
std::vector<at::Tensor> gather_projected_backward_kernel(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& weight,
    const std::vector<at::Tensor>& peer_parts, const Sharding& sharding, const Group& group);
std::vector<at::Tensor> scatter_heads_kernel(const std::vector<at::Tensor>& xs,
                                             const std::vector<Heads>& tensor_heads,
                                             const Sharding& sharding, const Group& group);
std::vector<at::Tensor> gather_heads_kernel(const std::vector<at::Tensor>& ys,
                                            const std::vector<Heads>& tensor_heads,
                                            const Sharding& sharding, const Group& group,
                                            HeadForm out);
std::vector<at::Tensor> scatter_head_parts_kernel(const std::vector<std::vector<at::Tensor>>& parts,
                                                  const std::vector<Heads>& tensor_heads,
                                                  const Sharding& sharding, const Group& group);
at::Tensor sequence_collective_kernel(const at::Tensor& x, int64_t dim,
                                      const SequencePartition& seq, const Group& group,
                                      SequenceCollective which, ShapeAgreement shapes);

}  // namespace detail
}  // namespace ulysses
