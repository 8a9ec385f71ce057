"""The pure planners, as plain Python values: each rank's heads and tokens (:func:`plan`) and
every Ulysses x ring split with its cost (:func:`plan_sp_mesh`). Both are the C++ planners
(partition.h, mesh_plan.h) through ``_C``.
"""

from __future__ import annotations

import functools

from . import _C


def plan(q_heads: int, kv_heads: int | None = None, sp: int = 1, seq_len: int | None = None) -> dict:
    """Each rank's heads (and tokens) for one attention over an SP group of ``sp`` ranks.

    Returns plain values: ``q_heads``/``kv_heads`` (per-rank counts), ``q_ranges``/``kv_ranges``
    (per-rank ``(start, end)`` global head indices), ``kv_map`` (per rank, the local kv head of
    each local query head) and, with ``seq_len``, ``seq_lens``. Raises ``ValueError`` for an
    invalid setup (e.g. fewer query heads than ranks).
    """
    return _C.plan(q_heads, q_heads if kv_heads is None else kv_heads, sp, seq_len)


@functools.lru_cache(maxsize=256)
def head_plan(q_heads: int, kv_heads: int, sp: int) -> dict:
    """:func:`plan` without tokens, cached: the fake kernels and the modules read it per call."""
    return _C.plan(q_heads, kv_heads, sp)


def plan_sp_mesh(sp: int, q_heads: int, kv_heads: int, seq_len: int, head_dim: int = 128,
                 batch: int = 1, elem_bytes: int = 2) -> list[dict]:
    """Every Ulysses x ring split ``U x R = sp`` with its per-rank cost of one attention layer
    (forward + backward): ``a2a_bytes``, ``ring_bytes``, ``ring_messages``, ``peak_bytes``,
    ``kv_replicas``. The first entry is the recommendation (fewest bytes moved)."""
    return _C.plan_sp_mesh(sp, q_heads, kv_heads, seq_len, head_dim, batch, elem_bytes)
