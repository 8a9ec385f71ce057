"""Functional ops over ``torch.ops.ulysses`` and their fake kernels.

The ops, their kernels and their autograd are C++ (src/<floor>/ops.cpp: one registration serves C++
and Python); this file registers, for each op, the fake kernel torch.compile traces with
(output shapes from the C++ planners). A process group is passed to the ops by its name, as
torch's functional collectives do, with the handle's options as integers (``[timeout ms]``);
the wrappers accept a ProcessGroup, a DeviceMesh dimension or a name.
"""

from __future__ import annotations

import datetime
import functools
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import GroupName

from . import _C

# A process group, its c10d name, a 1-D DeviceMesh (``mesh["sp"]``), a mesh dimension
# ``(mesh, "sp")``, or None for the default group.
GroupLike = str | dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, int | str] | None
# A collective's longest wait: a timedelta or seconds (None: DEFAULT_TIMEOUT).
Timeout = datetime.timedelta | float | None
DEFAULT_TIMEOUT = datetime.timedelta(milliseconds=_C.DEFAULT_TIMEOUT_MS)  # GroupOptions::timeout.
_ops = torch.ops.ulysses


def group_name(group: GroupLike) -> str:
    """The c10d name of ``group`` (see GroupLike)."""
    if isinstance(group, str):
        return group
    if isinstance(group, tuple):
        mesh, dim = group
        group = mesh.get_group(dim)
    elif isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"ulysses: a DeviceMesh group must be 1-D (e.g. mesh['sp']) or a (mesh, dim) "
                             f"pair; got a {group.ndim}-D mesh with dims {group.mesh_dim_names}")
        group = group.get_group()
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise ValueError("ulysses: no process group given and torch.distributed is not initialized")
    if not group.group_name:  # "" names this rank alone: never what a ProcessGroup means.
        raise ValueError(f"ulysses: the process group of rank {group.rank()} of {group.size()} has no name "
                         "(group_name is ''); pass a group made by torch.distributed (init_process_group, "
                         "new_group, a DeviceMesh)")
    return group.group_name


# The Gloo backends with_cpu_backend added, by process group: their timeouts are ours to raise.
_side_backends: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroupGloo] = weakref.WeakKeyDictionary()


def _backend_timeout(pg: dist.ProcessGroup) -> datetime.timedelta | None:
    """The longest timeout among the group's own backends (NCCL's is init_process_group's), or
    None where no backend shows one."""
    found = []
    for device in pg._device_types:
        timeout = getattr(getattr(pg._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            found.append(timeout)
    return max(found, default=None)


def with_cpu_backend(name: str, timeout: Timeout = None) -> None:
    """Gives the group ``name`` a Gloo backend for CPU tensors when it has none (a group made
    NCCL-only), so that each call's agreement moves its few integers host to host instead of
    through the GPU with a device-to-host copy (Note [Metadata device] in group.cpp). The Gloo
    backend rendezvouses through the group's own store, under a prefix of ours, among the
    group's ranks alone: every rank of the group calls this at the same point (the
    DistributedAttention constructor does). A group made with ``"cpu:gloo,cuda:nccl"`` (and
    DeviceMesh groups under such a world) already has one.

    Its timeout is the longer of ``timeout`` (the caller's; None: DEFAULT_TIMEOUT) and the
    group's own backends' (NCCL's default is 10 minutes), raised by a later caller's longer one:
    a rank late by less than the job allows (a checkpoint, an evaluation, a first compile) must
    not end the job here. The group keeps its name and description: registering a backend
    clears them (c10d reads the name from one backend, and the new one has none), and an
    unnamed group would read as this rank alone."""
    if not name:
        return
    pg = process_group(name)
    wait = datetime.timedelta(milliseconds=timeout_ms(timeout))
    if (own := _backend_timeout(pg)) is not None:
        wait = max(wait, own)
    if (ours := _side_backends.get(pg)) is not None:
        if ours.options._timeout < wait:
            ours.set_timeout(wait)
        return
    if any(d.type == "cpu" for d in pg._device_types):
        return
    store = dist.distributed_c10d._world.pg_map[pg][1]
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("ulysses/cpu/", store), pg.rank(), pg.size(), wait)
    description = pg.group_desc
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_group_name(GroupName(name))
    pg._set_group_desc(description)
    _side_backends[pg] = gloo


def timeout_ms(timeout: Timeout) -> int:
    """Milliseconds of a timedelta or of seconds (None: the default, 120 s)."""
    if timeout is None:  # Without timedelta arithmetic, which torch.compile cannot trace.
        return _C.DEFAULT_TIMEOUT_MS
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"ulysses: timeout must be > 0 seconds; got {seconds}")
    return max(1, int(round(seconds * 1000)))


def process_group(name: str) -> dist.ProcessGroup:
    """The live c10d process group registered under ``name``."""
    return torch._C._distributed_c10d._resolve_process_group(GroupName(name))


def group_options(timeout) -> list[int]:
    """The ops' ``group_options`` for a timeout (timedelta, seconds or None)."""
    return [timeout_ms(timeout)]


def rank_and_size(name: str) -> tuple[int, int]:
    """This rank's index in the group ``name`` and the group's size ((0, 1) for "")."""
    if not name:  # This rank alone.
        return 0, 1
    pg = process_group(name)
    return pg.rank(), pg.size()


@functools.lru_cache(maxsize=256)
def _plan(q_heads: int, kv_heads: int, sp: int) -> dict:
    return _C.plan(q_heads, kv_heads, sp)


@functools.lru_cache(maxsize=8)
def _dims(layout: str) -> tuple[int, int]:
    return _C.layout_dims(layout)


# ---- sequence_lengths ---------------------------------------------------------------------


@torch.library.register_fake("ulysses::sequence_lengths")
def _(x, dim, group, group_options):
    return torch.empty((rank_and_size(group)[1],), dtype=torch.long, device="cpu")  # as the kernel


def sequence_lengths(x: torch.Tensor, dim: int, group: GroupLike = None, timeout: Timeout = None) -> list[int]:
    """Every rank's length of ``x`` along ``dim`` (one small collective; eager only)."""
    return _ops.sequence_lengths(x, dim, group_name(group), group_options(timeout)).tolist()


# ---- scatter_heads / gather_heads -----------------------------------------------------------


def _a2a_shapes(xs, heads, q_heads, kv_heads, seq_lens, layout, group, to_heads: bool):
    rank, size = rank_and_size(group)
    plan = _plan(q_heads, kv_heads, size)
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


def scatter_heads(xs: Sequence[torch.Tensor], heads: Sequence[str], q_heads: int, kv_heads: int,
                  seq_lens: Sequence[int], layout: str = "BSHD", group: GroupLike = None,
                  timeout: Timeout = None) -> list[torch.Tensor]:
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
                 timeout: Timeout = None) -> list[torch.Tensor]:
    """The inverse of ``scatter_heads``: ``[B, S, H_r, D]`` back to ``[B, S_r, H, D]``.

    Replicated kv heads (Hkv < P) are summed over the ranks that hold them, which makes it the
    exact adjoint of ``scatter_heads``.
    """
    return _ops.gather_heads(list(ys), list(heads), q_heads, kv_heads, list(seq_lens), layout,
                             group_name(group), group_options(timeout))


# ---- head parts: heads split by rank beforehand (no pack, no unpack) -------------------------


@torch.library.register_fake("ulysses::scatter_head_parts")
def _(parts, heads, q_heads, kv_heads, seq_lens, layout, group, group_options, agree=True,
      mask=None, positions=None, causal=False, scale=0.0, step=False, check_mask=True, window=0, softcap=0.0,
      sinks=None):
    size = rank_and_size(group)[1]
    return _a2a_shapes(parts[::size], heads, q_heads, kv_heads, seq_lens, layout, group, True)


@torch.library.register_fake("ulysses::gather_head_parts")
def _(ys, heads, q_heads, kv_heads, seq_lens, layout, group, group_options):
    rank, size = rank_and_size(group)
    counts = _plan(q_heads, kv_heads, size)
    sdim, hdim = _dims(layout)
    outs = []
    for y, h in zip(ys, heads):
        for j in range(size):
            shape = list(y.shape)
            shape[sdim] = seq_lens[rank]
            shape[hdim] = counts["q_heads" if h == "q" else "kv_heads"][j]
            outs.append(y.new_empty(shape))
    return outs


def scatter_head_parts(parts: Sequence[Sequence[torch.Tensor]], heads: Sequence[str], q_heads: int,
                       kv_heads: int, seq_lens: Sequence[int], layout: str = "BSHD",
                       group: GroupLike = None, timeout: Timeout = None) -> list[torch.Tensor]:
    """``scatter_heads`` from head parts: ``parts[i][j]`` holds the heads rank ``j`` gets of
    tensor ``i`` (``[B, S_r, H_j, D]`` in BSHD, as ``project_head_parts`` makes them), so nothing
    is packed: each part is the message to its rank. Returns what ``scatter_heads`` returns for
    the whole tensors; differentiable (the backward is ``gather_head_parts``)."""
    flat = [p for tensor_parts in parts for p in tensor_parts]
    return _ops.scatter_head_parts(flat, list(heads), q_heads, kv_heads, list(seq_lens), layout,
                                   group_name(group), group_options(timeout))


def gather_head_parts(ys: Sequence[torch.Tensor], heads: Sequence[str], q_heads: int, kv_heads: int,
                      seq_lens: Sequence[int], layout: str = "BSHD", group: GroupLike = None,
                      timeout: Timeout = None) -> list[list[torch.Tensor]]:
    """``gather_heads`` into head parts: ``out[i][j]`` is rank ``j``'s heads of tensor ``i`` on
    this rank's tokens (``project_from_head_parts`` takes them), so nothing is unpacked.
    Replicated kv heads stay in their own parts. Differentiable."""
    flat = _ops.gather_head_parts(list(ys), list(heads), q_heads, kv_heads, list(seq_lens), layout,
                                  group_name(group), group_options(timeout))
    n = len(flat) // max(1, len(ys))
    return [flat[i * n:(i + 1) * n] for i in range(len(ys))]


# ---- projections overlapped with the exchanges -----------------------------------------------


@torch.library.register_fake("ulysses::scatter_projected")
def _(x, weights, biases, heads, q_heads, kv_heads, seq_lens, group, group_options, agree=True):
    rank, size = rank_and_size(group)
    counts = _plan(q_heads, kv_heads, size)
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
    rank, size = rank_and_size(group)
    counts = _plan(q_heads, kv_heads, size)["q_heads"]
    B, D, mine = y.shape[0], y.shape[3], seq_lens[rank]
    return [y.new_empty((B, mine, weight.shape[0]))] + \
        [y.new_empty((B, mine, counts[j], D)) for j in range(size) if j != rank]


@torch.library.register_fake("ulysses::gather_projected_backward")
def _(grad, y, weight, parts, q_heads, kv_heads, seq_lens, group, group_options):
    return torch.empty_like(y), torch.empty_like(weight)


def scatter_projected(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                      heads: Sequence[str], q_heads: int, kv_heads: int, seq_lens: Sequence[int],
                      group: GroupLike = None, timeout: Timeout = None) -> list[torch.Tensor]:
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
                     seq_lens: Sequence[int], group: GroupLike = None, timeout: Timeout = None) -> torch.Tensor:
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


def _seq_shape(x, dim, seq_lens, group, gathered: bool):
    rank, _ = rank_and_size(group)
    shape = list(x.shape)
    shape[dim] = sum(seq_lens) if gathered else seq_lens[rank]
    return x.new_empty(shape)


@torch.library.register_fake("ulysses::all_gather_sequence")
def _(x, dim, seq_lens, group, group_options, agree=True):
    return _seq_shape(x, dim, seq_lens, group, True)


@torch.library.register_fake("ulysses::reduce_scatter_sequence")
def _(x, dim, seq_lens, group, group_options, agree=True):
    return _seq_shape(x, dim, seq_lens, group, False)


def all_gather_sequence(x: torch.Tensor, dim: int, seq_lens: Sequence[int], group: GroupLike = None,
                        timeout: Timeout = None) -> torch.Tensor:
    """``[.., S_r, ..]`` shards along ``dim`` gathered into ``[.., S, ..]`` in rank order.

    Backward: ``reduce_scatter_sequence`` (sum over the group, keep this rank's rows).
    """
    return _ops.all_gather_sequence(x, dim, list(seq_lens), group_name(group), group_options(timeout))


def reduce_scatter_sequence(x: torch.Tensor, dim: int, seq_lens: Sequence[int],
                            group: GroupLike = None, timeout: Timeout = None) -> torch.Tensor:
    """Sum of ``x`` ``[.., S, ..]`` over the group, this rank's rows ``[.., S_r, ..]`` kept."""
    return _ops.reduce_scatter_sequence(x, dim, list(seq_lens), group_name(group),
                                        group_options(timeout))


# ---- rebuild_mask ------------------------------------------------------------------------------


@torch.library.register_fake("ulysses::rebuild_mask")
def _(mask, q_heads, kv_heads, seq_lens, group, group_options, key_len=-1):
    rank, _ = rank_and_size(group)
    shape = _C.rebuilt_mask_shape(list(mask.shape), q_heads, kv_heads, list(seq_lens), rank, key_len)
    return mask.new_empty(shape)


@torch.library.register_fake("ulysses::rebuild_mask_backward")
def _(grad, mask_sizes, q_heads, kv_heads, seq_lens, group, group_options, key_len=-1):
    return grad.new_empty(mask_sizes)


def rebuild_mask(mask: torch.Tensor, q_heads: int, kv_heads: int, seq_lens: Sequence[int],
                 group: GroupLike = None, timeout: Timeout = None) -> torch.Tensor:
    """``mask`` rebuilt for attention on this rank's query heads over the full sequence.

    Bool (true = attend) or additive float, 2-D ``[Sq, Sk]``, 3-D ``[heads, Sq, Sk]`` or 4-D
    ``[B, heads, Sq, Sk]`` with ``Sq`` in {S_r, S, 1}, ``Sk`` in {S, 1}, heads in {1, Hq}.
    Returns a 4-D mask broadcastable to ``[B, H_r, S, S]``. Differentiable for float masks.
    """
    return _ops.rebuild_mask(mask, q_heads, kv_heads, list(seq_lens), group_name(group),
                             group_options(timeout))


# ---- flash_attention ---------------------------------------------------------------------------


@torch.library.register_fake("ulysses::flash_attention")
def _(q, k, v, kv_map, mask, positions, causal, scale, rows, block_q=0, block_k=0, window=0, softcap=0.0,
      sinks=None):
    B, H, S, _ = q.shape
    return q.new_empty((B, H, S, v.shape[-1])), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.register_fake("ulysses::flash_attention_backward")
def _(grad_out, q, k, v, out, lse, kv_map, mask, positions, causal, scale, mask_grad, rows,
      block_q=0, block_k=0, window=0, softcap=0.0):
    dmask = mask.new_empty(mask.shape) if mask_grad else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


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


# Note [Local attention on the GPU]
# The C++ rule (attention.h, Note [Local attention by case]) has torch's SDPA and the math kernel
# off the CPU: any mask, document, window or global rows become a dense [B, 1, S, S] mask there
# (no flash), and a softcap or sinks the math kernel's S x S scores (bounded: refused above
# kMathScoresMaxBytes). From Python, "auto" on CUDA tensors takes SDPA for a call with no rule
# but causal (flash-eligible) and FlexAttention (ulysses.flex: a block mask and a score function,
# memory in S, never S^2) for every other. DistributedAttention runs it between attention_heads
# and the exchange back; the choice reads agreed facts only (device, mask and sinks given, window,
# softcap, position ids that split documents), so every rank makes it alike.
def _on_gpu(q: torch.Tensor) -> bool:
    """Whether "auto" takes the GPU's kernels for q (tests force it on CPU)."""
    return q.is_cuda


def gpu_local_kernel(mask: bool, documents: bool, window: int, softcap: float, sinks: bool) -> str:
    """The kernel "auto" runs on CUDA for a call with these facts (``documents``: position ids
    given): ``"sdpa"`` with no rule but causal, else ``"flex"`` (Note [Local attention on the GPU])."""
    return "flex" if mask or documents or window or softcap or sinks else "sdpa"


def local_kernel(q: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 causal: bool = False, window: int = 0, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> str:
    """The kernel ``local_attention(..., kernel="auto")`` runs for a call like this one (q BHSD)."""
    if _on_gpu(q):
        return gpu_local_kernel(mask is not None, positions is not None, window, softcap or 0.0, sinks is not None)
    return _C.chosen_local_kernel(q, mask, positions, causal, window, float(softcap or 0.0), sinks)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int],
                    mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                    causal: bool = False, scale: float | None = None,
                    kernel: str = "auto", window: int = 0, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Local attention (BHSD, as ``flash_attention``) on the exact kernel ``kernel`` names:
    ``"fused"`` (the CPU kernel), ``"sdpa"`` (torch's SDPA, any device), ``"math"`` (any dtype,
    fp64 exact), ``"flex"`` (torch's FlexAttention, ``ulysses.flex``) or ``"auto"``, the library's
    rule: on CPU the fused kernel, but math for fp64 and SDPA for bf16 with no rule but causal
    where the CPU has no AVX512-BF16 (Note [Local attention by case] in
    include/ulysses/attention.h); on CUDA SDPA with no rule but causal, flex for every other (Note
    [Local attention on the GPU]); on other devices SDPA, or math for a softcap or sinks.
    ``local_kernel`` names the choice."""
    if kernel == "auto" and _on_gpu(q):
        kernel = local_kernel(q, mask, positions, causal, window, softcap, sinks)
    if kernel == "flex":
        from . import flex

        return flex.attention(q, k, v, kv_map, mask, positions, causal, scale, window, float(softcap or 0.0),
                              sinks=sinks)
    return _ops.local_attention(q, k, v, list(kv_map), mask, positions, causal,
                                0.0 if scale is None else float(scale), kernel, window,
                                float(softcap or 0.0), sinks)


# ---- sum_over_group ----------------------------------------------------------------------------


@torch.library.register_fake("ulysses::sum_over_group")
def _(x, group, group_options):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def sum_over_group(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """``x`` summed over the ranks of ``group`` (an all-reduce; traceable by torch.compile).

    Backward passes the gradient through unchanged: each rank's gradient is its own part of
    the total, so gradients summed over the group afterwards are exact."""
    return _ops.sum_over_group(x, group_name(group), group_options(None))


def __getattr__(name: str):
    # The training helpers moved to ulysses.training; reachable here as before.
    if name in ("all_reduce_gradients", "shard_sequence"):
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module 'ulysses.ops' has no attribute {name!r}")
