"""The training helpers of sequence parallelism, in one place: this rank's shard of a batch
(:func:`shard_batch`, :func:`shard_sequence`), the exact global loss (:func:`sequence_parallel_loss`,
:func:`token_mean`) and gradients summed over the group (:func:`all_reduce_gradients`). Each is
the C++ rule (sharding.h) through ``torch.ops.ulysses``; ``ulysses.hf`` and the package's top
level re-export them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _C
from . import groups as G

#: The label that adds no loss (transformers' spelling; C++ ``kIgnoreIndex``).
IGNORE_INDEX: int = _C.IGNORE_INDEX


def shard_batch(batch: Mapping[str, torch.Tensor], group: G.GroupLike = None, *,
                ignore_index: int = IGNORE_INDEX) -> dict:
    """This rank's shard of an unsharded causal-LM batch ``{"input_ids": [B, S], "labels":
    [B, S] (optional: input_ids), "attention_mask": [B, S] (optional), "position_ids": [B, S]
    (optional: 0..S-1)}``.

    Labels are shifted on the full sequence first (token t predicts label t+1; the last token
    and every position whose input or target is padding predict ``ignore_index``), so no label
    is lost at a shard boundary. S need not
    divide by the group size (the first S % P ranks take one token more). Returns the sharded
    ``input_ids``, ``attention_mask`` (if given), global ``position_ids``, ``shift_labels`` (pass
    them to :func:`sequence_parallel_loss`, not to the model) and ``seq_lens`` (pass them to the
    model as ``ulysses_seq_lens=``: the forward then skips the small collective that learns
    every rank's token count).
    """
    pg = G.process_group(G.group_name(group))
    rank, P = pg.rank(), pg.size()
    mask = batch.get("attention_mask")
    # The rule (targets before the cut, padding, the split) has one home: C++ sharding.h.
    parts = torch.ops.ulysses.shard_batch(batch["input_ids"], batch.get("labels"), mask,
                                          batch.get("position_ids"), rank, P, 1, ignore_index)
    out = {"input_ids": parts[0], "position_ids": parts[2], "shift_labels": parts[1],
           "seq_lens": _C.sequence_split(batch["input_ids"].shape[1], P)}
    if mask is not None:
        out["attention_mask"] = parts[3]
    return out


#: How a training loop reduces gradients over the ranks, for the loss helpers' ``gradients=``.
GRADIENTS = ("summed", "averaged")


def _for_gradients(loss: torch.Tensor, gradients: str, averaged_over: G.GroupLike) -> torch.Tensor:
    """``loss`` scaled so that the gradients, reduced as ``gradients`` says, are the exact global
    mean's: "summed" (:func:`all_reduce_gradients`) as it is; "averaged" (DDP, FSDP2's
    ``fully_shard``: a mean over ``averaged_over``'s ranks) times that group's size."""
    if gradients == "summed":
        return loss
    if gradients == "averaged":
        return loss * G.process_group(G.group_name(averaged_over)).size()
    raise ValueError(f"gradients must be one of {', '.join(map(repr, GRADIENTS))}; got {gradients!r}")


def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group: G.GroupLike = None, *,
                           ignore_index: int = IGNORE_INDEX, gradients: str = "summed",
                           averaged_over: G.GroupLike = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of this rank's ``logits [B, S_r, V]`` against its (already shifted)
    labels, normalised by the token count of the whole ``group`` (every rank whose tokens make up
    the global batch: SP x DP). Returns ``(loss to backpropagate on this rank, the global mean,
    detached)``.

    ``gradients`` says how the loop reduces parameter gradients, so nobody scales by hand:
    ``"summed"`` (default): call :func:`all_reduce_gradients` over ``group`` after backward;
    ``"averaged"``: the parameters are wrapped by something that averages gradients over
    ``averaged_over`` (default: every rank), as DDP and FSDP2's ``fully_shard`` do; the loss is
    then multiplied by that group's size, and no other call is needed."""
    loss, mean = torch.ops.ulysses.sharded_cross_entropy(logits, shift_labels, G.group_name(group),
                                                         G.group_options(None), ignore_index)
    return _for_gradients(loss, gradients, averaged_over), mean


def token_mean(token_sum: torch.Tensor, shift_labels: torch.Tensor, group: G.GroupLike = None, *,
               ignore_index: int = IGNORE_INDEX, gradients: str = "summed",
               averaged_over: G.GroupLike = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_parallel_loss` for a summed token loss (``model(...,
    ulysses_shift_labels=...).loss`` under ``tiled_loss``): ``(token_sum / the group's token
    count, the global mean, detached)``, in one small agreement round (a rank whose loss failed
    fails every rank with its error). ``gradients`` and ``averaged_over`` as there."""
    loss, mean = torch.ops.ulysses.token_mean(token_sum, shift_labels, G.group_name(group), G.group_options(None),
                                              ignore_index)
    return _for_gradients(loss, gradients, averaged_over), mean


def all_reduce_gradients(model: torch.nn.Module, group: G.GroupLike = None) -> None:
    """Sums every parameter gradient over ``group`` (the SP x DP ranks whose losses were
    normalised together: ``ulysses.hf.sequence_parallel_loss``, ``ulysses.autosp``), in one flat
    collective."""
    name = G.group_name(group)
    params = [p for p in model.parameters() if p.requires_grad or p.grad is not None]
    # Which parameters have a gradient may differ by rank (an expert no token of this shard chose,
    # a vision tower that encoded no frame here): the C++ rule agrees on them first (sharding.h).
    grads = _C.gradients_of(params, name, G.Wait().code())
    if grads:  # One flat all-reduce per dtype (C++ sharding.h).
        torch.ops.ulysses.all_reduce_gradients(grads, name, G.group_options(None))


def shard_sequence(x: torch.Tensor, dim: int, sp_rank: int, sp_size: int, ring: int = 1) -> torch.Tensor:
    """SP rank ``sp_rank``'s tokens of the full ``x`` along ``dim`` in the hybrid layout of
    ``sp_size`` = Ulysses x ``ring`` ranks: the sequence is cut into 2R even chunks, ring rank r
    holds chunks r and 2R-1-r (zigzag: equal causal work), split evenly over its Ulysses ranks
    (SP rank = r * U + u). ``ring=1`` is Ulysses' contiguous even split."""
    _C.check_mesh_sizes(sp_size, sp_size, ring, "shard_sequence")  # The C++ rule (mesh_plan.h).
    index = _C.ring_shard_index(x.shape[dim], sp_size // ring, ring, sp_rank)
    return x.index_select(dim, torch.tensor(index, dtype=torch.long, device=x.device))


__all__ = ["GRADIENTS", "IGNORE_INDEX", "all_reduce_gradients", "sequence_parallel_loss", "shard_batch",
           "shard_sequence", "token_mean"]
