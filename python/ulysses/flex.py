"""Local attention on torch's FlexAttention (``torch.nn.attention.flex_attention``): every rule of
the library's local attention (attention.h: causal, sliding window, packed documents, bool and
additive masks, logit softcap; GQA through the partition's kv map) as a block mask and a score
function, never a dense ``[B, H, S, S]`` mask. ``DistributedAttention(local="flex")`` runs it on
each rank's heads.

On CUDA it runs compiled (one compiled flex per process; torch caches a kernel per shape family),
so its memory grows with S, not S^2, for every rule, and backward is compiled too. Elsewhere it
runs flex's eager path, which computes the same function by materialising the scores: that is
how CPU tests hold its rules exact (torch compiles flex for CPU for inference only).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


@functools.cache
def _compiled():
    return torch.compile(flex_attention)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """doc(b, i): how many position ids are 0 up to i (packed documents restart at 0), ``[B, S]``
    (attention.h's rule)."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=-1).view(-1, positions.shape[-1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int],
              mask: torch.Tensor | None = None, positions: torch.Tensor | None = None, causal: bool = False,
              scale: float | None = None, window: int = 0, softcap: float = 0.0,
              compiled: bool | None = None) -> torch.Tensor:
    """o for q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]`` (BHSD), query head h
    reading kv head ``kv_map[h]``; ``mask`` bool (true: attend) or additive float, broadcastable to
    ``[B, Hq, S, S]``; ``positions`` ``[B, S]`` or ``[S]`` (documents restart at 0); ``window`` with
    ``causal``: i - window < j <= i; ``softcap``: scores s become softcap * tanh(s / softcap) before
    an additive mask. A row with no allowed key gets 0. ``compiled``: run torch.compile's flex
    (default: on CUDA only; on CPU it serves inference only)."""
    B, Hq, S, _ = q.shape
    index = torch.tensor(list(kv_map), device=q.device)
    # Each query head's kv head, as the map says (flex's own GQA needs even groups, which uneven
    # head splits do not give): S x Hq x D, never S x S.
    k, v = k.index_select(1, index), v.index_select(1, index)
    rules = []
    if causal:
        rules.append(lambda b, h, i, j: j <= i)
    if window:
        rules.append(lambda b, h, i, j: i - j < window)
    if positions is not None:
        docs = document_ids(positions)
        one_row = docs.shape[0] == 1
        rules.append(lambda b, h, i, j: docs[0 if one_row else b, i] == docs[0 if one_row else b, j])
    bias = None
    if mask is not None:
        full = mask.expand(B, Hq, S, S)  # a view: the kernel reads entries, it never builds S x S
        if mask.dtype == torch.bool:
            rules.append(lambda b, h, i, j: full[b, h, i, j])
        else:
            bias = full

    def mask_mod(b, h, i, j):
        allowed = rules[0](b, h, i, j)
        for rule in rules[1:]:
            allowed = allowed & rule(b, h, i, j)
        return allowed

    def score_mod(s, b, h, i, j):
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if bias is not None:
            s = s + bias[b, h, i, j].to(s.dtype)
        return s

    block_mask = None
    if rules:
        per_head = mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] > 1
        block_mask = create_block_mask(mask_mod, B, Hq if per_head else None, S, S, device=q.device)
    run = _compiled() if (q.is_cuda if compiled is None else compiled) else flex_attention
    return run(q, k, v, score_mod=score_mod if softcap or bias is not None else None, block_mask=block_mask,
               scale=scale)


__all__ = ["attention", "document_ids"]
