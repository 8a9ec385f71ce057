"""The AutoSP rewrite's handlers for the nodes that need collectives: attention (one
``torch.ops.ulysses.attention`` call, the orchestration the module runs), token losses and
whole-tensor means (local sums and counts over the group). Each takes the rewriter."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import _C
from ..attention import attend
from .graph import AutoSPError, Shard, where
from .op_tables import LOSSES, SDPA_ARGS


def attention(rw: Any, node: fx.Node, args: tuple, full: torch.Tensor) -> None:
    call: dict[str, Any] = dict(zip(SDPA_ARGS, args[0]), **args[1])
    q, k, v, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
    if not all(isinstance(n, fx.Node) and rw.shard.get(n) == Shard(2) for n in (q, k, v)):
        raise AutoSPError(where(node, "attends with q, k and v not all sharded along their "
                                 "sequence dim 2 ([B, H, S, D])"))
    if call.get("dropout_p", 0.0):
        raise AutoSPError(where(node, "uses attention dropout; AutoSP attention has none"))
    k_source, v_source = repeat_source(rw, k), repeat_source(rw, v)
    if (k_source is not None and v_source is not None
            and rw.full[k_source].shape[1] == rw.full[v_source].shape[1]):
        k, v = k_source, v_source  # Move the kv heads, not their copies.
    hq, hkv = rw.full[q].shape[1], rw.full[k].shape[1]
    causal, scale = bool(call.get("is_causal", False)), call.get("scale")
    group, options, lens = rw.owner.group, rw.owner.options, rw.seq_lens
    probes = [rw.probe[n] for n in (q, k, v)]
    # The call DistributedAttention makes (ulysses.attention.attend: the C++ orchestration, or on
    # CUDA FlexAttention where the kernel rule names it), given the mask this graph rebuilt once
    # for every layer that shares it.
    rebuilt = rebuilt_mask(rw, node, mask, hq, hkv) if mask is not None else None
    out = rw.new[node] = rw.insert(attend, (
        q, k, v, rebuilt, None, hq, hkv, lens, "BHSD", causal, None if scale is None else float(scale),
        "auto", group, options), {"mask_rebuilt": mask is not None})
    with rw.mode:
        probe = full.new_empty((*full.shape[:2], rw.probe_len, full.shape[3]))
    rw.record(out, full, probe.requires_grad_(any(p.requires_grad for p in probes)), Shard(2))


def repeat_source(rw: Any, n: fx.Node) -> fx.Node | None:
    """``x`` when ``n`` is ``x``'s kv heads repeated for GQA the way transformers does it
    (``x[:, :, None].expand(B, Hkv, n_rep, S, D).reshape(B, Hkv * n_rep, S, D)``)."""
    expand = n.args[0] if n.op == "call_method" and n.target == "reshape" else None
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    index = expand.args[0]
    if not (isinstance(index, fx.Node) and index.target is operator.getitem
            and index.args[1] == (slice(None),) * 2 + (None,) + (slice(None),) * 2):
        return None
    src: Any = index.args[0]
    return src if rw.shard.get(src) == Shard(2) and rw.full[src].dim() == 4 else None


def rebuilt_mask(rw: Any, node: fx.Node, mask: fx.Node, hq: int, hkv: int) -> fx.Node:
    """The mask rebuilt for this rank's heads over all queries: once per mask (and head
    split, for a per-head mask)."""
    full, s = rw.full[mask], rw.shard[mask]
    if s is not None and s != Shard(full.dim() - 2):
        which = "key" if s.dim == full.dim() - 1 else f"{s.dim}"
        raise AutoSPError(where(node, f"gets a mask of shape {list(full.shape)} sharded along "
                                 f"its {which} dim; a mask must be full or sharded along its "
                                 "query dim (-2) only"))
    local = list(full.shape)
    if s is not None:
        local[s.dim] = rw.local_len
    try:  # The C++ mask rules decide (and word any error) as they will at run time.
        _C.rebuilt_mask_shape(local, hq, hkv, rw.seq_lens, rw.owner.rank)
    except ValueError as e:
        raise AutoSPError(where(node, str(e))) from None
    key = (mask, None if _C.mask_shared_across_heads(list(full.shape)) else (hq, hkv))
    if key not in rw.rebuilt_masks:
        rw.rebuilt_masks[key] = rw.insert(torch.ops.ulysses.rebuild_mask, (
            mask, hq, hkv, rw.seq_lens, rw.owner.group, rw.owner.options))
    return rw.rebuilt_masks[key]


def loss(rw: Any, node: fx.Node, args: tuple, full: torch.Tensor) -> None:
    """cross_entropy / nll_loss over sharded logits: the target is cut to this rank's
    tokens; a token mean becomes the global one (sum and count over the group)."""
    call = dict(LOSSES[node.target].bind(*args[0], **args[1]).arguments)
    logits, target = call["input"], call["target"]
    s = rw.shard[logits]
    if s is None or s.dim == 1 or call.get("reduce") is not None or call.get("size_average") is not None:
        raise AutoSPError(where(node, "computes a loss AutoSP cannot split by tokens (logits "
                                 "sharded along the class dim, or the deprecated "
                                 "size_average/reduce)"))
    want = Shard(s.dim if s.dim == 0 else s.dim - 1, s.outer, s.inner)
    if rw.shard[target] is None:
        call["target"] = rw.narrow(target, want)
    elif rw.shard[target] != want:
        raise AutoSPError(where(node, "gets a target sharded unlike its logits"))
    reduction = call.get("reduction", "mean")
    if reduction == "none":
        rw._copy(node, ((), call), full)
        return
    if reduction == "mean" and call.get("weight") is not None:
        raise AutoSPError(where(node, "takes a class-weighted token mean; use "
                                 "reduction='sum' and divide by the global weight"))
    local_sum = rw.insert(node.target, (), dict(call, reduction="sum"))
    if reduction == "sum":
        out = rw.insert(torch.ops.ulysses.sum_over_group, (local_sum, rw.owner.group, rw.owner.options))
    else:
        kept = rw.insert(operator.ne, (call["target"], call.get("ignore_index", _C.IGNORE_INDEX)))
        count = rw.insert(torch.sum, (kept,), {"dtype": full.dtype})
        stats = rw.insert(torch.stack, ([local_sum, count],))
        total = rw.insert(torch.ops.ulysses.sum_over_group, (stats, rw.owner.group, rw.owner.options))
        out = rw.insert(operator.truediv, (rw.insert(operator.getitem, (total, 0)),
                                              rw.insert(operator.getitem, (total, 1))))
    rw.new[node] = out
    rw.record(out, full)


def global_sum(rw: Any, node: fx.Node, args: tuple, full: torch.Tensor) -> None:
    """``x.sum()`` / ``x.mean()`` over every token: summed over the group (a mean divides by
    the full element count)."""
    src = args[0][0]
    local = rw.insert(torch.sum, (src,), args[1])
    out = rw.insert(torch.ops.ulysses.sum_over_group, (local, rw.owner.group, rw.owner.options))
    if node.target == "mean":
        out = rw.insert(operator.truediv, (out, rw.full[src].numel()))
    rw.new[node] = out
    rw.record(out, full)
