"""The functional ops over ``torch.ops.ulysses``: Python signatures with shapes in their
docstrings, each calling one C++ op (src/<floor>/ops.cpp: one registration serves C++ and
Python; fake kernels in ``ulysses.fake_kernels``). A process group is passed to the ops by its
name, as torch's functional collectives do, with the handle's options as integers
(``ulysses.groups``); the wrappers accept a ProcessGroup, a DeviceMesh dimension or a name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import _C
from .groups import GroupLike, Timeout, Wait, group_name, group_options

_ops = torch.ops.ulysses
#: The local attention kernels by name, "auto" first (C++ LocalKernel, attention.h).
LOCAL_KERNELS: tuple[str, ...] = tuple(_C.local_kernels())


# ---- sequence_lengths ---------------------------------------------------------------------


def sequence_lengths(x: torch.Tensor, dim: int, group: GroupLike = None, timeout: Timeout | Wait = None) -> list[int]:
    """Every rank's length of ``x`` along ``dim`` (one small collective; eager only)."""
    return _ops.sequence_lengths(x, dim, group_name(group), group_options(timeout)).tolist()


# ---- scatter_heads / gather_heads -----------------------------------------------------------


def scatter_heads(xs: Sequence[torch.Tensor], heads: Sequence[str], q_heads: int, kv_heads: int,
                  seq_lens: Sequence[int], layout: str = "BSHD", group: GroupLike = None,
                  timeout: Timeout | Wait = None) -> list[torch.Tensor]:
    """Sequence-sharded ``[B, S_r, H, D]`` tensors to head-sharded ``[B, S, H_r, D]`` (BSHD shown).

    ``heads[i]`` is ``"q"`` (Hq heads) or ``"kv"`` (Hkv heads) for ``xs[i]``; all tensors move in
    one all-to-all. ``seq_lens`` is every rank's token count. Every rank checks every rank's
    inputs first (one small collective), so a mismatch raises the same error everywhere.
    Differentiable: the backward is ``gather_heads``.
    """
    return _ops.scatter_heads(list(xs), list(heads), q_heads, kv_heads, list(seq_lens), layout,
                              group_name(group), group_options(timeout))


def gather_heads(ys: Sequence[torch.Tensor], heads: Sequence[str], q_heads: int, kv_heads: int,
                 seq_lens: Sequence[int], layout: str = "BSHD", group: GroupLike = None,
                 timeout: Timeout | Wait = None) -> list[torch.Tensor]:
    """The inverse of ``scatter_heads``: ``[B, S, H_r, D]`` back to ``[B, S_r, H, D]``.

    Replicated kv heads (Hkv < P) are summed over the ranks that hold them, which makes it the
    exact adjoint of ``scatter_heads``.
    """
    return _ops.gather_heads(list(ys), list(heads), q_heads, kv_heads, list(seq_lens), layout,
                             group_name(group), group_options(timeout))


# ---- head parts: heads split by rank beforehand (no pack, no unpack) -------------------------


def scatter_head_parts(parts: Sequence[Sequence[torch.Tensor]], heads: Sequence[str], q_heads: int,
                       kv_heads: int, seq_lens: Sequence[int], layout: str = "BSHD",
                       group: GroupLike = None, timeout: Timeout | Wait = None) -> list[torch.Tensor]:
    """``scatter_heads`` from head parts: ``parts[i][j]`` holds the heads rank ``j`` gets of
    tensor ``i`` (``[B, S_r, H_j, D]`` in BSHD, as ``project_head_parts`` makes them), so nothing
    is packed: each part is the message to its rank. Returns what ``scatter_heads`` returns for
    the whole tensors; differentiable (the backward is ``gather_head_parts``)."""
    flat = [p for tensor_parts in parts for p in tensor_parts]
    return _ops.scatter_head_parts(flat, list(heads), q_heads, kv_heads, list(seq_lens), layout,
                                   group_name(group), group_options(timeout))


def gather_head_parts(ys: Sequence[torch.Tensor], heads: Sequence[str], q_heads: int, kv_heads: int,
                      seq_lens: Sequence[int], layout: str = "BSHD", group: GroupLike = None,
                      timeout: Timeout | Wait = None) -> list[list[torch.Tensor]]:
    """``gather_heads`` into head parts: ``out[i][j]`` is rank ``j``'s heads of tensor ``i`` on
    this rank's tokens (``project_from_head_parts`` takes them), so nothing is unpacked.
    Replicated kv heads stay in their own parts. Differentiable."""
    flat = _ops.gather_head_parts(list(ys), list(heads), q_heads, kv_heads, list(seq_lens), layout,
                                  group_name(group), group_options(timeout))
    n = len(flat) // max(1, len(ys))
    return [flat[i * n:(i + 1) * n] for i in range(len(ys))]


# ---- projections overlapped with the exchanges -----------------------------------------------


def scatter_projected(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                      heads: Sequence[str], q_heads: int, kv_heads: int, seq_lens: Sequence[int],
                      group: GroupLike = None, timeout: Timeout | Wait = None) -> list[torch.Tensor]:
    """Input projections overlapped with the sequence -> heads exchange (BSHD): for ``x
    [B, S_r, E]`` and each ``weights[i] [H_i * D_i, E]`` (head-major rows, an ``nn.Linear``'s;
    ``biases[i]`` or None; ``heads[i]`` "q" or "kv"), returns ``scatter_heads`` of
    ``F.linear(x, weights[i], biases[i])`` viewed ``[B, S_r, H_i, D_i]``: ``[B, S, H_i_r, D_i]``.
    Each peer's heads are projected slab by slab (``message_bytes`` each) and sent while the next
    slab is projected; this rank's own heads go straight into the output. Every rank checks
    every rank's shapes first (one small collective). Differentiable in x, weights and biases."""
    return _ops.scatter_projected(x, list(weights), list(biases), list(heads), q_heads, kv_heads,
                                  list(seq_lens), group_name(group), group_options(timeout))


def gather_projected(y: torch.Tensor, weight: torch.Tensor, q_heads: int, kv_heads: int,
                     seq_lens: Sequence[int], group: GroupLike = None, timeout: Timeout | Wait = None) -> torch.Tensor:
    """The output projection overlapped with the heads -> sequence exchange (BSHD): for ``y
    [B, S, H_r, D]`` (this rank's query heads) and ``weight [E, Hq * D]``, returns
    ``F.linear(gather_heads(y).flatten(-2), weight)``: ``[B, S_r, E]``. Each peer's block is
    multiplied in as it arrives; this rank's own while the others travel. Differentiable."""
    return _ops.gather_projected(y, weight, q_heads, kv_heads, list(seq_lens), group_name(group),
                                 group_options(timeout))[0]


def _flat(ranges: Sequence[tuple[int, int]]) -> list[int]:
    return [int(v) for r in ranges for v in r]


def project_head_parts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       ranges: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """The input projection per rank: part ``j`` is ``F.linear(x, weight[rows of heads
    ranges[j]], bias[same])`` viewed ``[B, S_r, heads, D]``, for ``x [B, S_r, E]`` and
    ``weight [H * D, E]`` with head-major rows (an ``nn.Linear``'s). ``ranges``: the
    ``(start, end)`` head ranges by rank (``ulysses.plan(...)["q_ranges"]``). The C++ op (a
    composite of aten ops, so autograd and torch.compile go through it)."""
    return list(_ops.project_head_parts(x, weight, bias, _flat(ranges)))


def project_from_head_parts(parts: Sequence[torch.Tensor], weight: torch.Tensor,
                            ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The output projection of head parts: ``sum_j F.linear(parts[j].flatten(-2),
    weight[:, columns of heads ranges[j]])`` for ``weight [E, H * D]``: an ``nn.Linear`` of the
    whole gathered tensor without assembling it (accumulated part by part). The C++ op."""
    return _ops.project_from_head_parts(list(parts), weight, _flat(ranges))


# ---- all_gather_sequence / reduce_scatter_sequence -------------------------------------------


def all_gather_sequence(x: torch.Tensor, dim: int, seq_lens: Sequence[int], group: GroupLike = None,
                        timeout: Timeout | Wait = None) -> torch.Tensor:
    """``[.., S_r, ..]`` shards along ``dim`` gathered into ``[.., S, ..]`` in rank order.

    Backward: ``reduce_scatter_sequence`` (sum over the group, keep this rank's rows).
    """
    return _ops.all_gather_sequence(x, dim, list(seq_lens), group_name(group), group_options(timeout))


def reduce_scatter_sequence(x: torch.Tensor, dim: int, seq_lens: Sequence[int],
                            group: GroupLike = None, timeout: Timeout | Wait = None) -> torch.Tensor:
    """Sum of ``x`` ``[.., S, ..]`` over the group, this rank's rows ``[.., S_r, ..]`` kept."""
    return _ops.reduce_scatter_sequence(x, dim, list(seq_lens), group_name(group),
                                        group_options(timeout))


# ---- rebuild_mask ------------------------------------------------------------------------------


def rebuild_mask(mask: torch.Tensor, q_heads: int, kv_heads: int, seq_lens: Sequence[int],
                 group: GroupLike = None, timeout: Timeout | Wait = None) -> torch.Tensor:
    """``mask`` rebuilt for attention on this rank's query heads over the full sequence.

    Bool (true = attend) or additive float, 2-D ``[Sq, Sk]``, 3-D ``[heads, Sq, Sk]`` or 4-D
    ``[B, heads, Sq, Sk]`` with ``Sq`` in {S_r, S, 1}, ``Sk`` in {S, 1}, heads in {1, Hq}.
    Returns a 4-D mask broadcastable to ``[B, H_r, S, S]``. Differentiable for float masks.
    """
    return _ops.rebuild_mask(mask, q_heads, kv_heads, list(seq_lens), group_name(group),
                             group_options(timeout))


# ---- flash_attention ---------------------------------------------------------------------------


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int],
                    mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                    causal: bool = False, scale: float | None = None, window: int = 0,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The fused CPU attention kernel: q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]``
    (BHSD) -> ``[B, Hq, S, Dv]``. Query head h uses kv head ``kv_map[h]``; ``mask`` is bool or
    additive float broadcastable to ``[B, Hq, S, S]``; ``positions`` ``[B, S]`` or ``[S]`` are
    global position ids (packed documents restart at 0). ``window`` > 0 (with ``causal``): a
    sliding window, query i sees keys i - window < j <= i (tiles outside it are skipped).
    ``softcap`` > 0: scores s become ``softcap * tanh(s / softcap)`` before the mask (Gemma2's
    attn_logit_softcapping). ``sinks`` ``[Hq]``: attention sinks (gpt-oss's), one learnable logit
    per head added to each row's softmax denominator. Never materialises the S x S scores.
    """
    out, _ = _ops.flash_attention(q, k, v, list(kv_map), mask, positions, causal,
                                  0.0 if scale is None else float(scale), [], window=window,
                                  softcap=float(softcap or 0.0), sinks=sinks)
    return out


def _rule_device(q: torch.Tensor) -> str:
    """The device type the kernel rule reads for q (tests stand "cuda" in for the CPU)."""
    return q.device.type


def _chosen_kernel(device: str, dtype: torch.dtype, mask: bool, documents: bool, window: int, softcap: float,
                   sinks: bool, kernel: str) -> str:
    # The C++ rule, read as a constant of the call's facts (torch.compile does not trace into C++).
    return _C.chosen_local_kernel(device, dtype, mask, documents, window, softcap, sinks, kernel)


# torch.compiler.assume_constant_result's mark, set without importing the compiler (torch._dynamo
# costs every rank seconds of start-up; transformers marks its constants the same way).
_chosen_kernel._dynamo_marked_constant = True  # type: ignore[attr-defined]


def local_kernel(q: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 causal: bool = False, window: int = 0, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, kernel: str = "auto") -> str:
    """The kernel ``local_attention(..., kernel=kernel)`` runs for a call like this one (q BHSD):
    the one rule, in C++ (Note [Local attention by case] in include/ulysses/attention.h). On
    CUDA it names SDPA for a call with no rule but causal and ``"flex"`` (FlexAttention, which
    Python runs) for every other; on CPU the fused kernel (math for fp64, SDPA for plain bf16
    where the CPU has no AVX512-BF16)."""
    return _chosen_kernel(_rule_device(q), q.dtype, mask is not None, positions is not None, int(window or 0),
                          float(softcap or 0.0), sinks is not None, kernel)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int],
                    mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                    causal: bool = False, scale: float | None = None,
                    kernel: str = "auto", window: int = 0, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, step: Any = None) -> torch.Tensor:
    """Local attention (BHSD, as ``flash_attention``) on the exact kernel ``kernel`` names:
    ``"fused"`` (the CPU kernel), ``"sdpa"`` (torch's SDPA, any device), ``"math"`` (any dtype,
    fp64 exact), ``"flex"`` (torch's FlexAttention, ``ulysses.flex``) or ``"auto"``, the
    library's rule (:func:`local_kernel` names its choice). ``step``: a ``StepContext`` whose
    layers share FlexAttention's block mask."""
    kernel = local_kernel(q, mask, positions, causal, window, softcap, sinks, kernel)
    if kernel == "flex":
        from . import flex

        return flex.attention(q, k, v, kv_map, mask, positions, causal, scale, window, float(softcap or 0.0),
                              sinks=sinks, step=step)
    return _ops.local_attention(q, k, v, list(kv_map), mask, positions, causal,
                                0.0 if scale is None else float(scale), kernel, window,
                                float(softcap or 0.0), sinks)


# ---- sum_over_group ----------------------------------------------------------------------------


def sum_over_group(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """``x`` summed over the ranks of ``group`` (an all-reduce; traceable by torch.compile).

    Backward passes the gradient through unchanged: each rank's gradient is its own part of
    the total, so gradients summed over the group afterwards are exact."""
    return _ops.sum_over_group(x, group_name(group), group_options(None))

