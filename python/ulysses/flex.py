"""Local attention on torch's FlexAttention (``torch.nn.attention.flex_attention``): every rule of
the library's local attention (attention.h: causal, sliding window, packed documents, bool and
additive masks, logit softcap; GQA through the partition's kv map) as a block mask and a score
function, never a dense ``[B, H, S, S]`` mask. ``DistributedAttention(local="flex")`` runs it on
each rank's heads.

On CUDA it runs compiled (one compiled flex and one compiled block-mask builder per process;
torch caches a kernel per shape family), so its memory grows with S, not S^2, for every rule, and
backward is compiled too. Elsewhere it runs flex's eager path, which computes the same function by
materialising the scores: that is how CPU tests hold its rules exact (torch compiles flex for CPU
for inference only).

Sinks (gpt-oss) are one more key per head with logit ``sinks[h]`` and value 0 (attention.h): with
flex's log-sum-exp ``lse`` of a row, its output becomes ``o * exp(lse) / (exp(lse) + exp(sink))``
``= o * sigmoid(lse - sink)``, differentiable in ``sinks`` and, through ``lse``, in q and k.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention


@functools.cache
def _compiled():
    return torch.compile(flex_attention)


@functools.cache
def _compiled_block_mask():
    # Eager create_block_mask evaluates the rules on a dense [B, H, S, S] grid; compiled, it
    # works block by block (torch's advice in place of its _compile flag).
    return torch.compile(create_block_mask)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """doc(b, i): how many position ids are 0 up to i (packed documents restart at 0), ``[B, S]``
    (attention.h's rule)."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=-1).view(-1, positions.shape[-1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int],
              mask: torch.Tensor | None = None, positions: torch.Tensor | None = None, causal: bool = False,
              scale: float | None = None, window: int = 0, softcap: float = 0.0,
              compiled: bool | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """o for q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]`` (BHSD), query head h
    reading kv head ``kv_map[h]``; ``mask`` bool (true: attend) or additive float, broadcastable to
    ``[B, Hq, S, S]``; ``positions`` ``[B, S]`` or ``[S]`` (documents restart at 0); ``window`` with
    ``causal``: i - window < j <= i; ``softcap``: scores s become softcap * tanh(s / softcap) before
    an additive mask; ``sinks`` ``[Hq]``: one logit per query head added to every row's softmax
    denominator. A row with no allowed key gets 0. ``compiled``: run torch.compile's flex and
    block-mask builder (default: on CUDA only; on CPU flex compiles for inference only)."""
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

    compiled = q.is_cuda if compiled is None else compiled
    block_mask = None
    if rules:
        per_head = mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] > 1
        build = _compiled_block_mask() if compiled else create_block_mask
        block_mask = build(mask_mod, B, Hq if per_head else None, S, S, device=q.device)
    run = _compiled() if compiled else flex_attention
    score = score_mod if softcap or bias is not None else None
    if sinks is None:
        return run(q, k, v, score_mod=score, block_mask=block_mask, scale=scale)
    o, aux = run(q, k, v, score_mod=score, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[:, None])  # [B, Hq, S], lse fp32
    return (o * keep.unsqueeze(-1)).to(o.dtype)


__all__ = ["attention", "document_ids"]
