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

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

from . import _C
from . import groups as G
from . import ops as O
from .plans import head_plan

LocalAttention = Callable[..., torch.Tensor]
HeadChunks = int | Literal["auto"]


def check_head_chunks(head_chunks: object, who: str) -> None:
    """Raises ValueError unless ``head_chunks`` is an int >= 1 or "auto"."""
    if head_chunks != "auto" and (isinstance(head_chunks, bool) or not isinstance(head_chunks, int)
                                  or head_chunks < 1):
        raise ValueError(f"{who}: head_chunks must be an int >= 1 or 'auto'; got {head_chunks!r}")


def chunk_count(head_chunks: HeadChunks, q_heads: int, kv_heads: int, sp_size: int, recompute: bool = False) -> int:
    """The chunks a call runs in: ``head_chunks``, or for "auto" (C++ ``auto_head_chunks``) the
    most (up to 4) whose kv heads are each at least the group's size, none replicated; with
    ``recompute`` the most the heads allow (up to 8). Head counts that cannot be: 1 (the call's
    agreement refuses them, alike on every rank)."""
    if head_chunks != "auto":
        return int(head_chunks)
    return _C.auto_head_chunks(q_heads, kv_heads, sp_size, recompute) if min(q_heads, kv_heads) >= 1 else 1


class StepContext:
    """Per-forward-step cache shared by the attention layers of one model.

    A mask (or position ids) used by several layers is rebuilt (gathered) once per step, not
    once per layer, and later layers reuse the first one's agreement round (CPU tensors: each
    call's exchange carries a small index instead; a call that differs agrees again). Entries
    are keyed by the source tensor's identity and version counter, so a mask changed in place is
    rebuilt. Create one per forward step (eager mode; ignored while compiling). The tensors are
    cached in the C++ ``StepContext`` (include/ulysses/distributed_attention.h); :meth:`once`
    caches what Python derives (Python objects) beside it, by the same key.
    """

    def __init__(self) -> None:
        self._handle = torch.classes.ulysses.StepContext()
        self._built: list[tuple[tuple, tuple, object, object]] = []  # (sources, versions, key, result)

    def once(self, source: torch.Tensor | tuple | None, key: object, build: Callable[[], object]) -> object:
        """``build()``, computed once per (``source``, its version counter, ``key``) in this step:
        for what a caller derives from tensors every layer shares (ulysses.hf's gathered padding
        mask, a FlexAttention block mask). ``source``: a tensor, a tuple of tensors (or None
        entries), or None. Every rank must make the same calls, as for every collective
        ``build`` runs."""
        sources = source if isinstance(source, tuple) else (source,)
        versions = tuple(None if t is None else t._version for t in sources)
        for held, held_versions, k, result in self._built:
            if held_versions == versions and k == key and all(a is b for a, b in zip(held, sources)):
                return result
        result = build()
        self._built.append((sources, versions, key, result))
        return result

    @property
    def reuses(self) -> int:
        """Rebuilds saved so far."""
        return self._handle.reuses()

    @property
    def agreements_reused(self) -> int:
        """Agreement rounds skipped so far: calls with this context that moved by the group's
        armed agreement (Note [Reused agreement] in include/ulysses/distributed_attention.h)."""
        return self._handle.agreements_reused()


def _under_autocast(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, attention runs in its lower precision, as torch's SDPA does: a model's
    q (fp32 after RoPE) and v (bf16 from its projection) then meet in one dtype."""
    device = xs[0].device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # A device type autocast does not know (meta): never raise before the
        return xs  # call's agreement, which names the device on every rank.
    if not enabled:
        return xs
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in xs)


class DistributedAttention(nn.Module):
    """Sequence-parallel attention over the ranks of ``group``.

    A thin module over one C++ orchestration (``torch.ops.ulysses.attention``, the body of the
    C++ ``ulysses::DistributedAttention`` too): agree, exchange, mask rebuild, local attention
    (or a ring), exchange back.

    Args:
        group: the SP group: a ``torch.distributed`` ProcessGroup, a group name, a 1-D
            DeviceMesh (``mesh["sp"]``) or a ``(DeviceMesh, dim)`` pair; None means the
            default group.
        q_heads, kv_heads: total query / kv heads of this attention (None: taken from the first
            call's q and k). Hq must be a multiple of Hkv and >= the group size.
        layout: "BSHD" (HF, flash-attention), "SBHD" (Megatron) or "BHSD" (SDPA).
        causal: causal attention (within each packed document when position ids are given).
        scale: softmax scale (None: 1/sqrt(D)).
        window: a sliding window, with ``causal``: query i sees keys j with i - window < j <= i
            (global positions; within each document when packed). None or 0: no window. Every
            rank must give the same (part of the call's agreement). Not with a callable ``local``.
        softcap: a logit softcap: scores s become ``softcap * tanh(s / softcap)`` before the mask
            (Gemma2's ``attn_logit_softcapping``). None or 0: none. Agreed like ``window``; not
            with ``local="sdpa"`` or a callable.
        timeout: longest wait for any collective: a timedelta or a number of seconds (int or
            float); None: the group's own (the timeout its backends were made with).
            Note [One wait] in ulysses/groups.py.
        ring_group: for hybrid Ulysses x ring attention, the ring group (same forms as
            ``group``, which is then the Ulysses group): key/value blocks circulate over its R
            ranks. Inputs follow the zigzag layout (``ulysses.shard_sequence`` with
            ``ring=R``); a mask's rows are this shard's (or all S, or 1), its keys all S in
            global order (or 1). Eager mode, CPU tensors.
        local: the local attention: ``"auto"`` (the library's rule, in C++: Note [Local attention
            by case] in include/ulysses/attention.h; on CPU the fused kernel, math for fp64, SDPA
            for plain bf16 where the CPU has no AVX512-BF16; on CUDA SDPA with no rule but
            causal, FlexAttention for every other; SDPA on other devices, math there for a
            softcap or sinks), ``"fused"``, ``"sdpa"``, ``"math"``, ``"flex"`` (torch's
            FlexAttention with every rule as a block mask and score function, compiled on CUDA:
            ``ulysses.flex``; no ring), or a callable
            ``local(q, k, v, kv_map, mask, positions, causal, scale) -> o`` taking this rank's
            heads over the whole sequence in BHSD (q ``[B, Hq_r, S, D]``, k/v ``[B, Hkv_r, S,
            D]``; query head h uses kv head ``kv_map[h]``; ``mask`` rebuilt, broadcastable to
            ``[B, Hq_r, S, S]``, or None; ``positions`` ``[B, S]`` or None; ``scale`` a float or
            None) and returning ``[B, Hq_r, S, Dv]``, differentiable by autograd.
        head_chunks: attention in this many chunks of heads, one after another (exchange, local
            attention, exchange back per chunk; backward likewise), so only one chunk's exchange
            buffers and whole-sequence copies exist at a time (what backward keeps is not
            chunked): less transient memory, the same result. Chunk c is the c-th block of the
            kv heads with their query heads (1 to Hkv chunks, each with >= P query heads); a
            chunk with fewer kv heads than P replicates them, as any call does. "auto": the most
            chunks, up to 4, whose kv heads are each at least P (none replicated; 1 where
            Hkv < 2P), the least peak memory measured (docs/long_sequences.md); with
            ``recompute_chunks``, the most the heads allow, up to 8.
        recompute_chunks: each chunk (the whole call with ``head_chunks=1``) keeps only its
            inputs for backward and exchanges them again there (Note [Recomputed chunks],
            partition.h): nothing by heads lives from forward to backward. On the fused kernel
            (CPU, fp32/bf16/fp16) backward sends rowsum(do * o) of the chunk's heads to heads with
            o's gradient and runs the kernel's backward on the saved log-sum-exp, so the kernel's
            forward does not run again and the gradients are the kept chunks' bit for bit;
            elsewhere the chunk's whole call runs again. Backward reads o: keep it unchanged
            until then. Eager (under torch.compile the chunks keep what they save, as without
            it).
    """

    def __init__(self, group: G.GroupLike = None, *, q_heads: int | None = None, kv_heads: int | None = None,
                 layout: str = "BSHD", causal: bool = False, scale: float | None = None,
                 window: int | None = None, softcap: float | None = None, timeout: G.Timeout | G.Wait = None,
                 ring_group: G.GroupLike = None, local: str | LocalAttention = "auto",
                 head_chunks: HeadChunks = 1, recompute_chunks: bool = False) -> None:
        super().__init__()
        window = int(window or 0)
        softcap = float(softcap or 0.0)
        # The C++ module's rules (fail fast; the call's agreement checks them too).
        _C.check_attention_options(q_heads or 0, kv_heads or 0, causal, float(scale or 0.0), window, softcap)
        for name, given in (("window", window), ("softcap", softcap)):
            if given and callable(local):
                raise ValueError(f"DistributedAttention: a callable local attention takes no {name}; give "
                                 f"local='auto', 'fused' or 'math' with {name}=, or apply it inside the "
                                 f"callable ({name}=None)")
        if not callable(local) and local not in O.LOCAL_KERNELS:
            raise ValueError(f"DistributedAttention: local must be one of {', '.join(O.LOCAL_KERNELS)} or a "
                             f"callable; got {local!r}")
        self.group_name = G.group_name(group)
        G.with_cpu_backend(self.group_name, timeout)  # The agreement's integers stay on the host.
        self.ring_name = G.group_name(ring_group) if ring_group is not None else None
        ring_pg = G.process_group(self.ring_name) if self.ring_name is not None else None
        self.ring_rank, self.ring_size = (ring_pg.rank(), ring_pg.size()) if ring_pg is not None else (0, 1)
        if self.ring_size > 1:
            _C.check_ring_kernel("" if callable(local) else local)
        self.rank, self.sp_size = G.rank_and_size(self.group_name)
        self.layout = layout.upper()
        try:
            self.seq_dim, self.head_dim = _C.layout_dims(self.layout)
        except ValueError:
            raise ValueError(f"DistributedAttention: layout must be BSHD, SBHD or BHSD; got {layout!r}") from None
        self.causal = causal
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.local = local
        self.wait = G.wait(timeout)
        self._options = self.wait.options()  # The ops' group_options.
        self.q_heads, self.kv_heads = q_heads, kv_heads
        check_head_chunks(head_chunks, "DistributedAttention")
        self.head_chunks = head_chunks
        self.recompute_chunks = bool(recompute_chunks)
        if q_heads is not None:  # Fail fast on an invalid setup (kv heads may come later).
            _C.plan(q_heads, kv_heads if kv_heads is not None else 1, self.sp_size)
            if kv_heads is not None:
                _C.head_chunks(q_heads, kv_heads, self.sp_size,
                               chunk_count(head_chunks, q_heads, kv_heads, self.sp_size, self.recompute_chunks))

    def extra_repr(self) -> str:
        ring = f", ring={self.ring_name!r} ({self.ring_size} ranks)" if self.ring_size > 1 else ""
        local = self.local if isinstance(self.local, str) else getattr(self.local, "__name__", "callable")
        return (f"group={self.group_name!r}, sp={self.sp_size}{ring}, q_heads={self.q_heads}, "
                f"kv_heads={self.kv_heads}, layout={self.layout}, causal={self.causal}, "
                f"window={self.window or None}, softcap={self.softcap or None}, local={local}"
                + (f", head_chunks={self.head_chunks!r}" if self.head_chunks != 1 else "")
                + (", recompute_chunks=True" if self.recompute_chunks else ""))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                seq_lens: Sequence[int] | None = None, step: StepContext | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """o = attention(q, k, v) on this rank's sequence shard.

        q ``[B, S_r, Hq, D]``, k ``[B, S_r, Hkv, D]``, v ``[B, S_r, Hkv, Dv]`` (BSHD shown) ->
        ``[B, S_r, Hq, Dv]``. ``mask``: bool (true = attend) or additive float, e.g. a padding
        mask ``[B, 1, S_r, S]`` with query rows sharded (see ``rebuild_mask``). ``position_ids``:
        this shard's global positions ``[B, S_r]`` or ``[S_r]`` (packed documents restart at 0;
        ranks may mix the two forms). ``seq_lens``: every rank's token count (learned in the
        call's agreement round when None; required under torch.compile). ``step``: shares
        rebuilt masks across layers. ``sinks`` ``[Hq]``: attention sinks (gpt-oss's ``sinks``),
        one learnable logit per query head added to every row's softmax denominator; each rank
        applies its own heads' entries, so their gradient, like every parameter's, is summed
        over the group.
        """
        q, k, v = _under_autocast(q, k, v)
        hq, hkv = self._heads(q, k)
        o = attend(q, k, v, mask, position_ids, hq, hkv, self._seq_lens(seq_lens), self.layout, self.causal,
                   self.scale, self.local, self.group_name, self._options, ring=self.ring_name,
                   step=self._step(step), window=self.window, softcap=self.softcap, sinks=sinks,
                   head_chunks=chunk_count(self.head_chunks, hq, hkv, self.sp_size, self.recompute_chunks),
                   recompute_chunks=self.recompute_chunks)
        self.q_heads, self.kv_heads = hq, hkv  # This instance's from the first call on.
        return o

    def forward_parts(self, q: Sequence[torch.Tensor], k: Sequence[torch.Tensor],
                      v: Sequence[torch.Tensor], mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, seq_lens: Sequence[int] | None = None,
                      step: StepContext | None = None, sinks: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``forward`` with q, k, v as head parts and o returned as parts: part ``j`` holds the
        heads rank ``j`` gets (``ulysses.project_head_parts`` makes them from a projection's
        weight, ``ulysses.project_from_head_parts`` takes o's), so nothing is packed or
        unpacked around the all-to-alls. Needs ``q_heads`` and ``kv_heads`` at construction
        (parts do not show the totals); parts that do not fit raise the same error on every
        rank."""
        if self.q_heads is None or self.kv_heads is None:
            _C.fail_together("DistributedAttention.forward_parts: give q_heads and kv_heads at "
                             "construction (parts do not show the totals)", self.group_name,
                             self.wait.code(), before_attention=True)
        kv_heads = self.kv_heads or 1  # (given: fail_together raised otherwise)
        if (callable(self.local) or self.local == "flex" or self.recompute_chunks
                or chunk_count(self.head_chunks, self.q_heads or 1, kv_heads, self.sp_size) > 1):
            raise ValueError("DistributedAttention.forward_parts: a callable or flex local attention, "
                             "head_chunks and recompute_chunks take whole tensors; use forward")
        seq_lens = self._seq_lens(seq_lens)
        q, k, v = (list(_under_autocast(*parts)) for parts in (q, k, v))
        return torch.ops.ulysses.attention_parts(list(q), list(k), list(v), mask, position_ids, self.q_heads,
                                      self.kv_heads, seq_lens, self.layout, self.causal, self._scale(),
                                      self.local, self.group_name, self._options, self.ring_name,
                                      _handle(self._step(step)), window=self.window,
                             softcap=self.softcap, sinks=sinks)

    def _heads(self, q, k) -> tuple[int, int]:
        # Head counts not given are read from the first call's q and k (0 when not 4-D: the
        # call's agreement then raises the same error on every rank).
        hq = self.q_heads if self.q_heads is not None else (q.shape[self.head_dim] if q.dim() == 4 else 0)
        hkv = self.kv_heads if self.kv_heads is not None else (k.shape[self.head_dim] if k.dim() == 4 else 0)
        return hq, hkv

    def _seq_lens(self, seq_lens) -> list[int]:
        """Every rank's token count as given; [] (learned in the call's agreement) when None."""
        if seq_lens is not None:
            return [int(n) for n in seq_lens]
        if torch.compiler.is_compiling():
            raise ValueError("DistributedAttention: pass seq_lens (every rank's token count) "
                             "when compiling; a compiled graph cannot learn them")
        return []

    def _scale(self) -> float:
        return 0.0 if self.scale is None else float(self.scale)

    def _step(self, step: StepContext | None) -> StepContext | None:
        if self.ring_size > 1 and torch.compiler.is_compiling():
            raise ValueError("DistributedAttention: hybrid Ulysses x ring attention runs in eager mode only")
        return None if step is None or torch.compiler.is_compiling() else step


def _handle(step: StepContext | None):
    return None if step is None else step._handle


def _python_local(q: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None, causal: bool,
                  local: str | LocalAttention, ring: str | None, window: int, softcap: float,
                  sinks: torch.Tensor | None) -> bool:
    """Whether Python runs this call's local attention on this rank's heads: the caller's
    callable, or FlexAttention where the kernel rule (C++, ``ops.local_kernel``) names it for the
    call's facts, position ids counting as documents until gathered. Reads facts the call's
    agreement holds alike. ("auto" asks the rule, which never raises; a named kernel that cannot
    run the call is refused in the call's agreement, alike on every rank.)"""
    if callable(local) or local == "flex":
        return True
    return local == "auto" and ring is None and O.local_kernel(q, mask, positions, causal, window, softcap,
                                                               sinks) == "flex"


def _call_facts(layout: str, q_heads: int, kv_heads: int, group: str) -> tuple[int, list[int], list[int]]:
    """The sequence dim of ``layout``, its permutation from BHSD, and this rank's kv map: read from
    C++ as constants of the call (torch.compile does not trace into C++)."""
    rank, size = G.rank_and_size(group)
    return (_C.layout_dims(layout)[0], list(_C.bhsd_permutations(layout)[1]),
            list(head_plan(q_heads, kv_heads, size)["kv_map"][rank]))


# torch.compiler.assume_constant_result's mark (as ulysses.ops marks the kernel rule's).
_call_facts._dynamo_marked_constant = True  # type: ignore[attr-defined]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           positions: torch.Tensor | None, q_heads: int, kv_heads: int, seq_lens: Sequence[int], layout: str,
           causal: bool, scale: float | None, local: str | LocalAttention, group: str, options: list[int], *,
           ring: str | None = None, step: StepContext | None = None, window: int = 0, softcap: float = 0.0,
           sinks: torch.Tensor | None = None, mask_rebuilt: bool = False, head_chunks: int = 1,
           recompute_chunks: bool = False) -> torch.Tensor:
    """One attention call on this rank's shard, as ``DistributedAttention.forward`` and AutoSP's
    rewritten graphs run it: the C++ orchestration (``torch.ops.ulysses.attention``), or where
    Python runs the local attention (a callable; FlexAttention where the kernel rule names it)
    the orchestration's first half (``attention_heads``), the local attention on this rank's
    heads, then the exchange back. ``seq_lens`` [] learns the split in the call's agreement.
    ``head_chunks`` > 1: one such call per chunk of heads (Note [Head chunks], partition.h), in
    C++ where it runs the local attention in eager mode, else here (``_attend_in_head_chunks``)."""
    chunked = head_chunks > 1 or recompute_chunks
    python_local = _python_local(q, mask, positions, causal, local, ring, window, softcap, sinks)
    if chunked and (python_local or mask_rebuilt or torch.compiler.is_compiling()):
        return _attend_in_head_chunks(q, k, v, mask, positions, q_heads, kv_heads, seq_lens, layout, causal,
                                      scale, local, group, options, head_chunks, ring=ring, step=step,
                                      window=window, softcap=softcap, sinks=sinks, mask_rebuilt=mask_rebuilt,
                                      recompute=recompute_chunks)
    scale_arg = 0.0 if scale is None else float(scale)
    if not python_local:
        return torch.ops.ulysses.attention(q, k, v, mask, positions, q_heads, kv_heads, list(seq_lens), layout,
                                           causal, scale_arg, local, group, options, ring, _handle(step),
                                           mask_rebuilt, window=window, softcap=softcap, sinks=sinks,
                                           head_chunks=head_chunks, recompute_chunks=recompute_chunks)
    wait = G.Wait.of_code(options[0])
    seq_dim, from_bhsd, kv_map = _call_facts(layout, q_heads, kv_heads, group)
    if not seq_lens:
        seq_lens = O.sequence_lengths(q, seq_dim, group, wait)
    # Sinks given on some ranks only: a local raise would hang the others (in attention_heads).
    if callable(local) and sinks is not None:
        _C.fail_together("DistributedAttention: a callable local attention takes no sinks; use a kernel name "
                         "(\"auto\", \"fused\", \"math\", \"flex\")", group, wait.code(), before_attention=True)
    if local == "flex" and not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        _C.fail_together("DistributedAttention: local=\"flex\" runs forward only off CUDA (torch has no CPU "
                         "backward for FlexAttention); train with local=\"auto\" there, or run under "
                         "torch.no_grad()", group, wait.code(), before_attention=True)
    heads = torch.ops.ulysses.attention_heads(q, k, v, mask, positions, q_heads, kv_heads, list(seq_lens), layout,
                                              causal, scale_arg, group, options, _handle(step), mask_rebuilt,
                                              window=window, softcap=softcap, sinks=sinks)
    qh, kh, vh, rest = heads[0], heads[1], heads[2], list(heads[3:])
    m = rest.pop(0) if mask is not None else None
    # Ids that split no row into documents come back dropped (no rule: the C++ orchestration's).
    kept = len(rest) > (sinks is not None)
    p = rest.pop(0) if positions is not None and kept else None
    if callable(local):
        if window or softcap:  # Agreed above: every rank raises alike.
            raise ValueError("DistributedAttention: a callable local attention takes no window or softcap; "
                             "apply it inside the callable")
        o = local(qh, kh, vh, kv_map, m, p, causal, scale)
    else:  # This rank's heads' sinks (agreed above) come last.
        o = O.local_attention(qh, kh, vh, kv_map, m, p, causal, scale, kernel=local, window=window,
                              softcap=softcap, sinks=rest.pop(0) if rest else None, step=step)
    o = o.permute(from_bhsd)
    return torch.ops.ulysses.gather_heads([o], ["q"], q_heads, kv_heads, list(seq_lens), layout, group, options)[0]


def _head_chunks(q_heads: int, kv_heads: int, group: str, count: int, layout: str) -> tuple[list, int]:
    """Each chunk's ((q begin, end), (kv begin, end)) (C++ ``head_chunks``) and the layout's head
    dim: constants of the call, read from C++ (torch.compile does not trace into C++)."""
    return _C.head_chunks(q_heads, kv_heads, G.rank_and_size(group)[1], count), _C.layout_dims(layout)[1]


_head_chunks._dynamo_marked_constant = True  # type: ignore[attr-defined]


class _GradientBuffer:
    """The one gradient the chunks of an input write their heads' parts into (Note [Head chunks])."""

    def __init__(self, x: torch.Tensor, slices: int) -> None:
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.slices = self.left = slices
        self.grad: torch.Tensor | None = None


class _HeadsOf(torch.autograd.Function):
    """``x.narrow(dim, begin, end - begin)`` whose backward writes into the input's one gradient
    buffer: k chunks make one input-sized gradient, not k (narrow's backward is a zero-filled
    input-sized tensor per chunk)."""

    @staticmethod
    def forward(ctx, x, dim, begin, end, buffer):  # type: ignore[override]
        ctx.dim, ctx.begin, ctx.end, ctx.buffer = dim, begin, end, buffer
        return x.narrow(dim, begin, end - begin)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        buffer = ctx.buffer
        if buffer.grad is None:
            buffer.grad = torch.zeros(buffer.shape, dtype=buffer.dtype, device=buffer.device)
        buffer.grad.narrow(ctx.dim, ctx.begin, ctx.end - ctx.begin).add_(grad)  # k may be v
        buffer.left -= 1
        if buffer.left:
            return None, None, None, None, None
        whole, buffer.grad, buffer.left = buffer.grad, None, buffer.slices  # (again, for retain_graph)
        return whole, None, None, None, None


class _PutHeads(torch.autograd.Function):
    """``out.narrow(dim, begin, n).copy_(part)`` in place, returning ``out``: each chunk's output
    lands in o as it comes and is freed, where a concatenation would hold every chunk's output and
    o at once. Backward hands each chunk its heads' slice of o's gradient (a view)."""

    @staticmethod
    def forward(ctx, out, part, dim, begin):  # type: ignore[override]
        ctx.mark_dirty(out)
        ctx.dim, ctx.begin, ctx.n = dim, begin, part.shape[dim]
        out.narrow(dim, begin, ctx.n).copy_(part)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, grad.narrow(ctx.dim, ctx.begin, ctx.n), None, None


class _Recomputed(torch.autograd.Function):
    """``run(*inputs)`` without autograd, kept for backward as its inputs only; backward runs it
    again with autograd (the chunk's exchange and kernel) and backpropagates through that, so
    nothing by heads lives from forward to backward."""

    @staticmethod
    def forward(ctx, run, group, wait_code, *inputs):  # type: ignore[override]
        ctx.run, ctx.group, ctx.wait_code = run, group, wait_code
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return run(*inputs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        try:
            saved = ctx.saved_tensors
        except RuntimeError as e:  # (an input changed in place, a second backward): on every rank alike
            _C.fail_together(f"DistributedAttention (recompute_chunks): backward recomputes each chunk from its "
                             f"saved inputs: {e}", ctx.group, ctx.wait_code, before_attention=True)
        inputs = [None if t is None else t.detach().requires_grad_(needs)
                  for t, needs in zip(saved, ctx.needs_input_grad[3:], strict=True)]
        with torch.enable_grad():
            out = ctx.run(*inputs)
        _C.free_if_unshared(out)  # its graph is all backward reads
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, None, *(next(grads) if t is not None and t.requires_grad else None for t in inputs))


def _attend_in_head_chunks(q, k, v, mask, positions, q_heads, kv_heads, seq_lens, layout, causal, scale, local,
                           group, options, count, **call) -> torch.Tensor:
    """``attend`` on each chunk of heads in turn, where Python runs the local attention or a call
    is traced (elsewhere the C++ ``attend_in_head_chunks`` runs them, as for the C++
    ``DistributedAttention``): slices of q, k, v (and of a per-head mask and the sinks) in, each output
    put into o as it comes (``_PutHeads``); in backward each chunk's input gradients go into one
    buffer per input (``_HeadsOf``). So one chunk's exchange buffers, whole-sequence tensors and
    gradients by heads exist at a time beyond what the call keeps; with ``recompute`` each chunk
    keeps only its inputs and runs again in backward (``_Recomputed``). A chunk count this rank
    cannot make fails every rank alike."""
    sinks = call.pop("sinks")
    if (not seq_lens and not torch.compiler.is_compiling()
            and _python_local(q, mask, positions, causal, local, call["ring"], call["window"], call["softcap"], sinks)):
        # Learned once (each chunk's call would learn them again), so that a failure below meets
        # the others' chunk calls where they start: in attention_heads.
        seq_lens = O.sequence_lengths(q, _C.layout_dims(layout)[0], group, G.Wait.of_code(options[0]))
    try:
        chunks, dim = _head_chunks(q_heads, kv_heads, group, count, layout)
    except ValueError as e:
        _C.fail_together(f"DistributedAttention: {e}", group, options[0], before_attention=True)
    per_head_mask = mask is not None and mask.dim() == 4 and mask.shape[1] == q_heads > 1
    # One gradient buffer per input (k and v may be one tensor: it then has two slices a chunk).
    uses: dict[int, int] = {}
    for t in (q, k, v):
        uses[id(t)] = uses.get(id(t), 0) + len(chunks)
    streams = torch.is_grad_enabled() and not torch.compiler.is_compiling()
    recompute = call.pop("recompute") and streams
    if recompute:  # A step's shared masks would carry forward's graph (none) into backward.
        call["step"] = None
    buffers = {id(t): _GradientBuffer(t, uses[id(t)]) for t in (q, k, v) if t.requires_grad and streams}

    def heads(t, d, block):
        if id(t) in buffers:
            return _HeadsOf.apply(t, d, block[0], block[1], buffers[id(t)])
        return t.narrow(d, block[0], block[1] - block[0])

    outs, o = [], None
    for q_block, kv_block in chunks:
        def run(qc, kc, vc, mc, sc, hq=q_block[1] - q_block[0], hkv=kv_block[1] - kv_block[0]):
            return attend(qc, kc, vc, mc, positions, hq, hkv, seq_lens, layout, causal, scale, local, group,
                          options, sinks=sc, **call)

        inputs = (heads(q, dim, q_block), heads(k, dim, kv_block), heads(v, dim, kv_block),
                  heads(mask, 1, q_block) if per_head_mask else mask,
                  None if sinks is None else heads(sinks, 0, q_block))
        part = _Recomputed.apply(run, group, options[0], *inputs) if recompute else run(*inputs)
        if not streams:
            outs.append(part)
            continue
        if o is None:
            shape = list(part.shape)
            shape[dim] = q_heads
            o = part.new_empty(shape)
        o = _PutHeads.apply(o, part, dim, q_block[0])
        del part  # freed here: its heads live on in o
    if outs:
        return torch.cat(outs, dim)
    assert o is not None  # at least one chunk
    return o
