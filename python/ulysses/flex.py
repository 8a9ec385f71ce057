"""Local attention on torch's FlexAttention (``torch.nn.attention.flex_attention``): every rule of
the library's local attention (attention.h: causal, sliding window, packed documents, bool and
additive masks, logit softcap; GQA through the partition's kv map) as a block mask and a score
function, never a dense ``[B, H, S, S]`` mask. The kernel rule (C++, attention.h) names it on CUDA
for every call with a rule; ``DistributedAttention(local="flex")`` runs it anywhere.

On CUDA it runs compiled (one compiled flex and one compiled block-mask builder per process), so
its memory grows with S, not S^2, for every rule, and backward is compiled too. What a compiled
graph specialises on is kept small, so that a model's layers compile a bounded number of times:
the rule functions are module-level (one per mix of rules), their constants (window, softcap)
are device tensors made once per process, and the sequence dim is dynamic. A step's layers share
one block mask through the step's ``StepContext`` (built once per step, not per layer), and a kv
map that groups query heads evenly runs flex's own GQA (no copy of k and v per query head).
Elsewhere it runs flex's eager path, which computes the same function by materialising the
scores: that is how CPU tests hold its rules exact (torch compiles flex for CPU for inference
only).

Sinks (gpt-oss) are one more key per head with logit ``sinks[h]`` and value 0 (attention.h): with
flex's log-sum-exp ``lse`` of a row, its output becomes ``o * exp(lse) / (exp(lse) + exp(sink))``
``= o * sigmoid(lse - sink)``, differentiable in ``sinks`` and, through ``lse``, in q and k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

#: Calls of the compiled flex and block-mask builder so far, and the graphs torch.compile made for
#: them: what a test and the GPU check read to hold the compile count bounded.
compile_stats = {"calls": 0, "block_masks": 0}


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


@functools.lru_cache(maxsize=64)
def _constant(value: float | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d device tensor of ``value``, made once per process: a compiled graph reads it as an
    input (no recompile for another value) and no call copies it to the device again."""
    return torch.tensor(value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=64)
def _kv_index(kv_map: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The kv map as a device index, made once per process (not a host copy per call)."""
    return torch.tensor(kv_map, dtype=torch.long, device=device)


def gqa_group(kv_map: Sequence[int], kv_heads: int) -> int | None:
    """The query heads per kv head when ``kv_map`` groups them evenly (query head h reads kv head
    h // g, flex's own GQA), else None (an uneven head split: k and v are indexed per head)."""
    hq = len(kv_map)
    if kv_heads < 1 or hq % kv_heads:
        return None
    g = hq // kv_heads
    return g if all(kv_map[h] == h // g for h in range(hq)) else None


# The rules, module-level: a compiled graph sees one function per mix of rules, whatever tensors
# it reads.
def _causal(b, h, i, j, c):
    return j <= i


def _window(b, h, i, j, c):
    return i - j < c["window"]


def _documents(b, h, i, j, c):
    return c["docs"][b, i] == c["docs"][b, j]


def _bool_mask(b, h, i, j, c):
    return c["mask"][b, h, i, j]


def _mask_mod(rules: tuple[Callable, ...], tensors: dict[str, torch.Tensor]) -> Callable:
    def mask_mod(b, h, i, j):
        allowed = rules[0](b, h, i, j, tensors)
        for rule in rules[1:]:
            allowed = allowed & rule(b, h, i, j, tensors)
        return allowed

    return mask_mod


def _score_mod(tensors: dict[str, torch.Tensor], softcap: bool, bias: bool) -> Callable:
    def score_mod(s, b, h, i, j):
        if softcap:
            cap = tensors["softcap"].to(s.dtype)
            s = cap * torch.tanh(s / cap)
        if bias:
            s = s + tensors["bias"][b, h, i, j].to(s.dtype)
        return s

    return score_mod


def _block_mask(q: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None, causal: bool,
                window: int, compiled: bool) -> tuple[Any, torch.Tensor | None]:
    """The block mask of the call's rules (None: no rule) and the additive bias (a float mask)."""
    B, Hq, S, _ = q.shape
    rules: list[Callable] = []
    tensors: dict[str, torch.Tensor] = {}
    if causal:
        rules.append(_causal)
    if window:
        rules.append(_window)
        tensors["window"] = _constant(int(window), torch.int64, q.device)
    if positions is not None:
        rules.append(_documents)
        tensors["docs"] = document_ids(positions).expand(B, S)
    bias = None
    per_head = False
    if mask is not None:
        full = mask.expand(B, Hq, S, S)  # a view: the kernel reads entries, it never builds S x S
        if mask.dtype == torch.bool:
            rules.append(_bool_mask)
            tensors["mask"] = full
            per_head = mask.dim() == 4 and mask.shape[1] > 1
        else:
            bias = full
    if not rules:
        return None, bias
    build = _compiled_block_mask() if compiled else create_block_mask
    compile_stats["block_masks"] += 1
    return build(_mask_mod(tuple(rules), tensors), B, Hq if per_head else None, S, S, device=q.device), bias


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int],
              mask: torch.Tensor | None = None, positions: torch.Tensor | None = None, causal: bool = False,
              scale: float | None = None, window: int = 0, softcap: float = 0.0,
              compiled: bool | None = None, sinks: torch.Tensor | None = None, step: Any = None) -> torch.Tensor:
    """o for q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]`` (BHSD), query head h
    reading kv head ``kv_map[h]``; ``mask`` bool (true: attend) or additive float, broadcastable to
    ``[B, Hq, S, S]``; ``positions`` ``[B, S]`` or ``[S]`` (documents restart at 0); ``window`` with
    ``causal``: i - window < j <= i; ``softcap``: scores s become softcap * tanh(s / softcap) before
    an additive mask; ``sinks`` ``[Hq]``: one logit per query head added to every row's softmax
    denominator. A row with no allowed key gets 0. ``compiled``: run torch.compile's flex and
    block-mask builder (default: on CUDA only; on CPU flex compiles for inference only).
    ``step``: a ``ulysses.StepContext`` whose layers share one block mask (built once per step)."""
    B, Hq, S, _ = q.shape
    group = gqa_group(kv_map, k.shape[1])
    if group is None:  # Each query head's kv head, as the map says: S x Hq x D, never S x S.
        index = _kv_index(tuple(int(h) for h in kv_map), q.device)
        k, v = k.index_select(1, index), v.index_select(1, index)
    compiled = q.is_cuda if compiled is None else compiled

    def build() -> tuple[Any, torch.Tensor | None]:
        return _block_mask(q, mask, positions, causal, window, compiled)

    if step is None:
        block_mask, bias = build()
    else:  # One block mask for the step's layers like this one (same tensors, rules and shape).
        key = ("flex block mask", causal, int(window), B, Hq, S, q.device, compiled)
        block_mask, bias = step.once((mask, positions), key, build)
    tensors = {"bias": bias} if bias is not None else {}
    if softcap:
        tensors["softcap"] = _constant(float(softcap), torch.float32, q.device)
    score = _score_mod(tensors, bool(softcap), bias is not None) if softcap or bias is not None else None
    run = _compiled() if compiled else flex_attention
    if compiled:
        compile_stats["calls"] += 1
    gqa = group is not None and group > 1
    if sinks is None:
        return run(q, k, v, score_mod=score, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    o, aux = run(q, k, v, score_mod=score, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                 return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[:, None])  # [B, Hq, S], lse fp32
    return (o * keep.unsqueeze(-1)).to(o.dtype)


__all__ = ["attention", "compile_stats", "document_ids", "gqa_group"]
