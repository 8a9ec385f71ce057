"""The fake kernels of the ``torch.ops.ulysses`` ops: the output shapes (from the C++ planners)
that torch.compile traces with. The ops, their kernels and their autograd are C++
(src/<floor>/ops.cpp); importing the package registers these beside them.
"""

from __future__ import annotations

import functools

import torch

from . import _C
from . import groups as G
from .plans import head_plan


@functools.lru_cache(maxsize=8)
def _dims(layout: str) -> tuple[int, int]:
    return _C.layout_dims(layout)


@torch.library.register_fake("ulysses::sequence_lengths")
def _(x, dim, group, group_options):
    return torch.empty((G.rank_and_size(group)[1],), dtype=torch.long, device="cpu")  # as the kernel


def _a2a_shapes(xs, heads, q_heads, kv_heads, seq_lens, layout, group, to_heads: bool):
    rank, size = G.rank_and_size(group)
    plan = head_plan(q_heads, kv_heads, size)
    sdim, hdim = _dims(layout)
    outs = []
    for x, h in zip(xs, heads):
        shape = list(x.shape)
        if to_heads:
            shape[sdim] = sum(seq_lens)
            shape[hdim] = plan["q_heads" if h == "q" else "kv_heads"][rank]
        else:
            shape[sdim] = seq_lens[rank]
            shape[hdim] = q_heads if h == "q" else kv_heads
        outs.append(x.new_empty(shape))
    return outs


@torch.library.register_fake("ulysses::scatter_heads")
def _(xs, heads, q_heads, kv_heads, seq_lens, layout, group, group_options, agree=True, mask=None,
      positions=None, causal=False, scale=0.0, step=False, check_mask=True, window=0, softcap=0.0,
      sinks=None):
    return _a2a_shapes(xs, heads, q_heads, kv_heads, seq_lens, layout, group, True)


@torch.library.register_fake("ulysses::gather_heads")
def _(ys, heads, q_heads, kv_heads, seq_lens, layout, group, group_options):
    return _a2a_shapes(ys, heads, q_heads, kv_heads, seq_lens, layout, group, False)


@torch.library.register_fake("ulysses::scatter_head_parts")
def _(parts, heads, q_heads, kv_heads, seq_lens, layout, group, group_options, agree=True,
      mask=None, positions=None, causal=False, scale=0.0, step=False, check_mask=True, window=0, softcap=0.0,
      sinks=None):
    size = G.rank_and_size(group)[1]
    return _a2a_shapes(parts[::size], heads, q_heads, kv_heads, seq_lens, layout, group, True)


@torch.library.register_fake("ulysses::gather_head_parts")
def _(ys, heads, q_heads, kv_heads, seq_lens, layout, group, group_options):
    rank, size = G.rank_and_size(group)
    counts = head_plan(q_heads, kv_heads, size)
    sdim, hdim = _dims(layout)
    outs = []
    for y, h in zip(ys, heads):
        for j in range(size):
            shape = list(y.shape)
            shape[sdim] = seq_lens[rank]
            shape[hdim] = counts["q_heads" if h == "q" else "kv_heads"][j]
            outs.append(y.new_empty(shape))
    return outs


@torch.library.register_fake("ulysses::scatter_projected")
def _(x, weights, biases, heads, q_heads, kv_heads, seq_lens, group, group_options, agree=True):
    rank, size = G.rank_and_size(group)
    counts = head_plan(q_heads, kv_heads, size)
    outs = []
    for w, h in zip(weights, heads):
        total = q_heads if h == "q" else kv_heads
        outs.append(x.new_empty((x.shape[0], sum(seq_lens), counts["q_heads" if h == "q" else "kv_heads"][rank],
                                 w.shape[0] // total)))
    return outs


@torch.library.register_fake("ulysses::scatter_projected_backward")
def _(grads, x, weights, biases, heads, q_heads, kv_heads, seq_lens, group, group_options):
    return [torch.empty_like(x)] + [torch.empty_like(w) for w in weights] + \
        [torch.empty_like(b) for b in biases if b is not None]


@torch.library.register_fake("ulysses::gather_projected")
def _(y, weight, q_heads, kv_heads, seq_lens, group, group_options, agree=True):
    rank, size = G.rank_and_size(group)
    counts = head_plan(q_heads, kv_heads, size)["q_heads"]
    B, D, mine = y.shape[0], y.shape[3], seq_lens[rank]
    return [y.new_empty((B, mine, weight.shape[0]))] + \
        [y.new_empty((B, mine, counts[j], D)) for j in range(size) if j != rank]


@torch.library.register_fake("ulysses::gather_projected_backward")
def _(grad, y, weight, parts, q_heads, kv_heads, seq_lens, group, group_options):
    return torch.empty_like(y), torch.empty_like(weight)


def _seq_shape(x, dim, seq_lens, group, gathered: bool):
    rank, _ = G.rank_and_size(group)
    shape = list(x.shape)
    shape[dim] = sum(seq_lens) if gathered else seq_lens[rank]
    return x.new_empty(shape)


@torch.library.register_fake("ulysses::all_gather_sequence")
def _(x, dim, seq_lens, group, group_options, agree=True):
    return _seq_shape(x, dim, seq_lens, group, True)


@torch.library.register_fake("ulysses::reduce_scatter_sequence")
def _(x, dim, seq_lens, group, group_options, agree=True):
    return _seq_shape(x, dim, seq_lens, group, False)


@torch.library.register_fake("ulysses::rebuild_mask")
def _(mask, q_heads, kv_heads, seq_lens, group, group_options, key_len=-1):
    rank, _ = G.rank_and_size(group)
    shape = _C.rebuilt_mask_shape(list(mask.shape), q_heads, kv_heads, list(seq_lens), rank, key_len)
    return mask.new_empty(shape)


@torch.library.register_fake("ulysses::rebuild_mask_backward")
def _(grad, mask_sizes, q_heads, kv_heads, seq_lens, group, group_options, key_len=-1):
    return grad.new_empty(mask_sizes)


@torch.library.register_fake("ulysses::flash_attention")
def _(q, k, v, kv_map, mask, positions, causal, scale, rows, block_q=0, block_k=0, window=0, softcap=0.0,
      sinks=None):
    B, H, S, _ = q.shape
    return q.new_empty((B, H, S, v.shape[-1])), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.register_fake("ulysses::flash_attention_backward")
def _(grad_out, q, k, v, delta, lse, kv_map, mask, positions, causal, scale, mask_grad, rows,
      block_q=0, block_k=0, window=0, softcap=0.0):
    dmask = mask.new_empty(mask.shape) if mask_grad else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


@torch.library.register_fake("ulysses::sum_over_group")
def _(x, group, group_options):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
