"""``ulysses.DistributedAttention``: Ulysses sequence-parallel attention as an ``nn.Module``.

    q, k, v on this rank's sequence shard [B, S_r, H, D] (BSHD; or SBHD, BHSD)
      --scatter_heads (one fused all-to-all)-->  [B, S, my heads, D]
    mask rebuilt for (all queries, my heads); position ids gathered to [B, S]
    local attention on my heads over the full sequence (GQA through the partition's kv map)
      --gather_heads-->  o on this rank's shard [B, S_r, Hq, Dv]

Head counts belong to the instance (given, or captured from the first call): two instances
with different head counts share a process freely. Every step is a torch.ops.ulysses op, so
the module traces under torch.compile (pass ``seq_lens`` there: a compiled graph cannot learn
them from the other ranks).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import _C
from . import ops as O


@torch.compiler.assume_constant_result
def _local_kv_map(q_heads: int, kv_heads: int, sp: int, rank: int) -> list[int]:
    # A pure function of integers: torch.compile evaluates it once while tracing.
    return O._plan(q_heads, kv_heads, sp)["kv_map"][rank]


_DTYPE_CODES = {dt: i for i, dt in enumerate(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
     torch.bfloat16, torch.float32, torch.float64))}


def _agreed_call_values(qkv, mask, positions, causal, step) -> tuple[list[str], list[int]]:
    """Names and values of a call that every rank must hold alike; ``qkv``: q, k and v (or all
    their parts), q's (or its first part's) device first."""
    device = qkv[0].device

    def kind(t):
        if t is None:
            return [0, -1, -1, 0, 1]
        return [1, t.dim(), _DTYPE_CODES.get(t.dtype, 99), int(t.requires_grad), int(t.device == device)]

    m, p = kind(mask), kind(positions)
    names = ["whether a mask is given", "the mask's number of dims", "the mask's dtype (code)",
             "whether the mask requires grad", "whether the mask is on q's device",
             "whether position ids are given", "the position ids' number of dims",
             "the position ids' dtype (code)", "whether the position ids require grad",
             "whether the position ids are on q's device", "whether q, k or v require grad", "causal",
             "whether a StepContext is used"]
    grad = any(t.requires_grad for t in qkv)
    return names, m + p + [int(grad), int(causal), int(step is not None)]


def _local_problem(q, k, v, layout) -> str:
    """What this rank alone can see is wrong before any op runs (the dispatcher itself would
    reject tensors on several devices, or the head dims could not be read)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return (f"q, k and v must be 4-D ({layout}); got {tuple(q.shape)}, {tuple(k.shape)} and "
                f"{tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        return f"q, k and v must be on one device; got {q.device}, {k.device} and {v.device}"
    return ""


class StepContext:
    """Per-forward-step cache shared by the attention layers of one model.

    A mask (or position ids) used by several layers is rebuilt (gathered) once per step, not
    once per layer. Entries are keyed by the source tensor's identity and version counter, so a
    mask changed in place is rebuilt. Create one per forward step (eager mode).
    """

    def __init__(self) -> None:
        self._entries: list[tuple[torch.Tensor, int, tuple, torch.Tensor]] = []
        self.reuses = 0  # Rebuilds saved so far.

    def get(self, source: torch.Tensor, key: tuple, build) -> torch.Tensor:
        for src, version, k, result in self._entries:
            if src is source and version == source._version and k == key:
                self.reuses += 1
                return result
        result = build()
        self._entries.append((source, source._version, key, result))
        return result


class DistributedAttention(nn.Module):
    """Sequence-parallel attention over the ranks of ``group``.

    Args:
        group: the SP group: a ``torch.distributed`` ProcessGroup, a group name, or a
            ``(DeviceMesh, dim)`` pair; None means the default group.
        q_heads, kv_heads: total query / kv heads of this attention (None: taken from the first
            call's q and k). Hq must be a multiple of Hkv and >= the group size.
        layout: "BSHD" (HF, flash-attention), "SBHD" (Megatron) or "BHSD" (SDPA).
        causal: causal attention (within each packed document when position ids are given).
        scale: softmax scale (None: 1/sqrt(D)).
        timeout: longest wait for any collective (timedelta or seconds; default 120 s).
        ring_group: for hybrid Ulysses x ring attention, the ring group (same forms as
            ``group``, which is then the Ulysses group): key/value blocks circulate over its R
            ranks. Inputs follow the zigzag layout (``ulysses.shard_sequence`` with
            ``ring=R``); a mask's rows are this shard's (or all S, or 1), its keys all S in
            global order (or 1). Eager mode, CPU tensors.
    """

    def __init__(self, group=None, *, q_heads: int | None = None, kv_heads: int | None = None,
                 layout: str = "BSHD", causal: bool = False, scale: float | None = None,
                 timeout: datetime.timedelta | float | None = None, ring_group=None) -> None:
        super().__init__()
        for name, value in (("q_heads", q_heads), ("kv_heads", kv_heads)):
            if value is not None and value < 1:
                raise ValueError(f"DistributedAttention: {name} must be >= 1 (or None: taken from "
                                 f"the first call); got {value}")
        if isinstance(group, tuple):  # (DeviceMesh, dim)
            mesh, dim = group
            group = mesh.get_group(dim)
        self.group_name = O.group_name(group)
        if isinstance(ring_group, tuple):
            mesh, dim = ring_group
            ring_group = mesh.get_group(dim)
        self.ring_name = O.group_name(ring_group) if ring_group is not None else None
        ring_pg = O.process_group(self.ring_name) if ring_group is not None else None
        self.ring_rank, self.ring_size = (ring_pg.rank(), ring_pg.size()) if ring_pg is not None else (0, 1)
        pg = O.process_group(self.group_name)
        self.rank, self.sp_size = pg.rank(), pg.size()
        self.layout = layout.upper()
        try:
            self.seq_dim, self.head_dim = _C.layout_dims(self.layout)
        except ValueError:
            raise ValueError(f"DistributedAttention: layout must be BSHD, SBHD or BHSD; got {layout!r}") from None
        self._to_bhsd, self._from_bhsd = _C.bhsd_permutations(self.layout)
        self.causal = causal
        self.scale = scale
        self.timeout_ms = O.timeout_ms(timeout)
        self.q_heads, self.kv_heads = q_heads, kv_heads
        if q_heads is not None:  # Fail fast on an invalid setup (kv heads may come later).
            _C.plan(q_heads, kv_heads if kv_heads is not None else 1, self.sp_size)

    def extra_repr(self) -> str:
        ring = f", ring={self.ring_name!r} ({self.ring_size} ranks)" if self.ring_size > 1 else ""
        return (f"group={self.group_name!r}, sp={self.sp_size}{ring}, q_heads={self.q_heads}, "
                f"kv_heads={self.kv_heads}, layout={self.layout}, causal={self.causal}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                seq_lens: Sequence[int] | None = None, step: StepContext | None = None) -> torch.Tensor:
        """o = attention(q, k, v) on this rank's sequence shard.

        q ``[B, S_r, Hq, D]``, k ``[B, S_r, Hkv, D]``, v ``[B, S_r, Hkv, Dv]`` (BSHD shown) ->
        ``[B, S_r, Hq, Dv]``. ``mask``: bool (true = attend) or additive float, e.g. a padding
        mask ``[B, 1, S_r, S]`` with query rows sharded (see ``rebuild_mask``). ``position_ids``:
        this shard's global positions ``[B, S_r]`` or ``[S_r]`` (packed documents restart at 0).
        ``seq_lens``: every rank's token count (learned with one small collective when None;
        required under torch.compile). ``step``: shares rebuilt masks across layers.
        """
        problem = _local_problem(q, k, v, self.layout)
        if problem:  # Raised on every rank, through the round the other ranks' ops run.
            _C.fail_together(f"DistributedAttention: {problem}", self.group_name, self.timeout_ms)
        if self.q_heads is None or self.kv_heads is None:
            # Head counts not given are captured on this instance from the first call; the
            # ops' agreement round makes ranks that disagree fail together.
            if self.q_heads is None:
                self.q_heads = q.shape[self.head_dim]
            if self.kv_heads is None:
                self.kv_heads = k.shape[self.head_dim]
        hq, hkv = self.q_heads, self.kv_heads
        seq_lens = self._seq_lens(q, seq_lens)
        args = (hq, hkv, seq_lens)
        # Everything that decides which collectives follow is agreed in the scatter's round: a
        # rank whose call differs fails together with the others instead of hanging them.
        names, values = _agreed_call_values((q, k, v), mask, position_ids, self.causal, step)
        qh, kh, vh = O._ops.scatter_heads([q, k, v], ["q", "kv", "kv"], *args, self.layout,
                                          self.group_name, self.timeout_ms, names, values)
        o = self._attend(qh, kh, vh, mask, position_ids, args, step)
        return O._ops.gather_heads([o], ["q"], *args, self.layout, self.group_name, self.timeout_ms)[0]

    def forward_parts(self, q: Sequence[torch.Tensor], k: Sequence[torch.Tensor],
                      v: Sequence[torch.Tensor], mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, seq_lens: Sequence[int] | None = None,
                      step: StepContext | None = None) -> list[torch.Tensor]:
        """``forward`` with q, k, v as head parts and o returned as parts: part ``j`` holds the
        heads rank ``j`` gets (``ulysses.project_head_parts`` makes them from a projection's
        weight, ``ulysses.project_from_head_parts`` takes o's), so nothing is packed or
        unpacked around the all-to-alls. Needs ``q_heads`` and ``kv_heads`` at construction
        (parts do not show the totals); parts that do not fit raise the same error on every
        rank."""
        if self.q_heads is None or self.kv_heads is None:
            _C.fail_together("DistributedAttention.forward_parts: give q_heads and kv_heads at "
                             "construction (parts do not show the totals)", self.group_name,
                             self.timeout_ms)
        seq_lens = self._seq_lens(q[0], seq_lens)
        args = (self.q_heads, self.kv_heads, seq_lens)
        names, values = _agreed_call_values((*q, *k, *v), mask, position_ids, self.causal, step)
        qh, kh, vh = O._ops.scatter_head_parts([*q, *k, *v], ["q", "kv", "kv"], *args, self.layout,
                                               self.group_name, self.timeout_ms, names, values)
        o = self._attend(qh, kh, vh, mask, position_ids, args, step)
        return O._ops.gather_head_parts([o], ["q"], *args, self.layout, self.group_name,
                                        self.timeout_ms)

    def _seq_lens(self, x: torch.Tensor, seq_lens: Sequence[int] | None) -> list[int]:
        """Every rank's token count: given, or learned with one small collective."""
        if seq_lens is None:
            if torch.compiler.is_compiling():
                raise ValueError("DistributedAttention: pass seq_lens (every rank's token count) "
                                 "when compiling; a compiled graph cannot learn them")
            seq_lens = O.sequence_lengths(x, self.seq_dim, self.group_name, self.timeout_ms / 1000)
        return [int(n) for n in seq_lens]

    def _attend(self, qh, kh, vh, mask, position_ids, args, step) -> torch.Tensor:
        """Attention on this rank's heads over the whole sequence (q, k, v after the scatter);
        o in the module's layout, ready for the gather."""
        hq, hkv, seq_lens = args
        group, t = self.group_name, self.timeout_ms
        if mask is not None and self.ring_size == 1:
            build = lambda: O._ops.rebuild_mask(mask, *args, group, t)  # noqa: E731
            shared = mask.dim() < 3 or mask.shape[-3] == 1
            mask = step.get(mask, ("mask", shared or (hq, hkv), tuple(seq_lens)), build) if step else build()
        if position_ids is not None:
            build = lambda: O._ops.all_gather_sequence(position_ids, -1, seq_lens, group, t)  # noqa: E731
            position_ids = step.get(position_ids, ("positions", tuple(seq_lens)), build) if step else build()
        perm = self._to_bhsd
        kv_map = _local_kv_map(hq, hkv, self.sp_size, self.rank)
        if self.ring_size > 1:
            o = self._ring_attention(qh.permute(perm), kh.permute(perm), vh.permute(perm), kv_map,
                                     mask, position_ids, args, step)
        else:
            o = local_attention(qh.permute(perm), kh.permute(perm), vh.permute(perm), kv_map, mask,
                                position_ids, self.causal, self.scale)
        return o.permute(self._from_bhsd)

    def _ring_attention(self, q, k, v, kv_map, mask, positions, args, step):
        """Ring attention of this ring rank's tokens (q, k, v BHSD, my heads) over the ring.
        ``mask``: as given (rows: this shard's, all S or 1; keys: all S in global order or 1)."""
        ring, t = self.ring_name, self.timeout_ms
        if torch.compiler.is_compiling():  # Raised on every ring rank, through the round the others run next.
            _C.fail_together("DistributedAttention: hybrid Ulysses x ring attention runs in eager mode only", ring, t)
        # Every ring rank's token count (one small agreement round), hence S and the layout.
        lengths = O._ops.sequence_lengths(q, 2, ring, t).tolist()
        S = sum(lengths)
        expected = _C.ring_lengths(S, self.sp_size, self.ring_size)
        if lengths != expected:  # Every rank sees the same lengths: raised alike.
            raise ValueError(f"DistributedAttention: ring ranks hold {lengths} tokens; the zigzag layout of {S} "
                             f"tokens gives {expected} (shard inputs with ulysses.shard_sequence(..., ring=R))")
        key = ("ring", S, self.ring_rank * self.sp_size + self.rank, tuple(args[-1]))
        if mask is not None:
            build = lambda: self._ring_mask(mask, S, args)  # noqa: E731
            shared = mask.dim() < 3 or mask.shape[-3] == 1
            mask = step.get(mask, key + ("mask", shared or args[:2]), build) if step else build()
        docs = None
        if positions is not None:
            build = lambda: O._ops.ring_document_ids(positions, S, self.sp_size, ring, t)  # noqa: E731
            docs = step.get(positions, key + ("documents",), build) if step else build()
        scale = 0.0 if self.scale is None else float(self.scale)
        out, _ = O._ops.ring_attention(q, k, v, list(kv_map), mask, docs, self.causal, scale, S, self.sp_size,
                                       ring, t)
        return out

    def _ring_mask(self, mask, S, args):
        """The mask's rows for this ring rank's queries and my heads, keys still global. Full
        rows are cut to this rank's shard first, then gathered over the Ulysses group like
        sharded rows. A refusal anywhere fails every rank of the SP group alike: the Ulysses
        group agrees in rebuild_mask, then the ring group in one more round."""
        m = mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        mine = _C.ring_shard_index(S, self.sp_size, self.ring_size, self.ring_rank * self.sp_size + self.rank)
        if m.shape[2] == S and len(mine) != S:
            m = m.index_select(2, torch.tensor(mine, device=m.device))
        error = ""
        if m.shape[-1] not in (S, 1):
            error = (f"DistributedAttention: with a ring, a mask's keys must be all {S} (in global order) or 1; "
                     f"got {tuple(mask.shape)}")
        try:
            if error:  # Through the Ulysses group's round (rebuild_mask's agreement on the others).
                _C.fail_together(error, self.group_name, self.timeout_ms)
            m = O._ops.rebuild_mask(m, *args, self.group_name, self.timeout_ms, S)
        except ValueError as e:
            error = str(e)
        if error:
            _C.fail_together(error, self.ring_name, self.timeout_ms)
        O._ops.sequence_lengths(m, 0, self.ring_name, self.timeout_ms)  # The ring's round: all passed.
        return m


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int],
                    mask: torch.Tensor | None, positions: torch.Tensor | None, causal: bool,
                    scale: float | None) -> torch.Tensor:
    """Attention of head-sharded BHSD q ``[B, Hq_r, S, D]`` over k/v ``[B, Hkv_r, S, D]``; query
    head h uses kv head ``kv_map[h]``; ``mask`` already rebuilt (see ``rebuild_mask``)."""
    if q.device.type == "cpu" and q.dtype != torch.float64:
        out, _ = O._ops.flash_attention(q, k, v, list(kv_map), mask, positions, causal,
                                        0.0 if scale is None else float(scale))
        return out
    # Note [Local attention by device]: other devices use SDPA (flash / memory-efficient
    # backends on CUDA) with kv heads expanded through the kv map.
    if positions is not None:
        raise NotImplementedError("DistributedAttention: packed documents (position_ids) "
                                  f"are implemented by the CPU kernel only; got {q.device}")
    index = torch.tensor(list(kv_map), device=q.device)
    k, v = k.index_select(1, index), v.index_select(1, index)
    if causal and mask is not None:
        S = q.shape[2]
        tril = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        mask = mask & tril if mask.dtype == torch.bool else mask.masked_fill(~tril, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
