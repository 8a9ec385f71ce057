"""Ulysses sequence parallelism for transformer attention (C++ core, PyTorch front end).

Loading the package registers the ``torch.ops.ulysses`` operators.
"""

from __future__ import annotations

from importlib import metadata as _metadata

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _environment  # noqa: F401  (refuses another torch or a clashing package first)

# isort: split
from . import _C
from .attention import DistributedAttention, StepContext
from .ops import (
    all_gather_sequence,
    all_reduce_gradients,
    flash_attention,
    gather_head_parts,
    gather_heads,
    gather_projected,
    local_attention,
    project_from_head_parts,
    project_head_parts,
    rebuild_mask,
    reduce_scatter_sequence,
    scatter_head_parts,
    scatter_heads,
    scatter_projected,
    sequence_lengths,
    shard_sequence,
    sum_over_group,
)

__version__ = _metadata.version(_environment.DISTRIBUTION)  # One home: pyproject.toml.

import os as _os  # noqa: E402


def __getattr__(name: str):
    # The compile backend loads torch's compiler stack (torch._dynamo, fake tensors): only when
    # used, so `import ulysses` (every rank's start-up) does not pay for it.
    if name in ("autosp", "mark_sequence"):
        from . import auto

        return getattr(auto, name)
    raise AttributeError(f"module 'ulysses' has no attribute {name!r}")


#: CMAKE_PREFIX_PATH entry for C++ users: find_package(ulysses) then links ulysses::ulysses
#: (the library this package loads), with torch.utils.cmake_prefix_path for Torch.
cmake_prefix_path = _os.path.join(_os.path.dirname(_C.__file__), "share", "cmake")


def plan(q_heads: int, kv_heads: int | None = None, sp: int = 1, seq_len: int | None = None) -> dict:
    """Each rank's heads (and tokens) for one attention over an SP group of ``sp`` ranks.

    Returns plain values: ``q_heads``/``kv_heads`` (per-rank counts), ``q_ranges``/``kv_ranges``
    (per-rank ``(start, end)`` global head indices), ``kv_map`` (per rank, the local kv head of
    each local query head) and, with ``seq_len``, ``seq_lens``. Raises ``ValueError`` for an
    invalid setup (e.g. fewer query heads than ranks).
    """
    return _C.plan(q_heads, q_heads if kv_heads is None else kv_heads, sp, seq_len)


def plan_sp_mesh(sp: int, q_heads: int, kv_heads: int, seq_len: int, head_dim: int = 128,
                 batch: int = 1, elem_bytes: int = 2) -> list[dict]:
    """Every Ulysses x ring split ``U x R = sp`` with its per-rank cost of one attention layer
    (forward + backward): ``a2a_bytes``, ``ring_bytes``, ``ring_messages``, ``peak_bytes``,
    ``kv_replicas``. The first entry is the recommendation (fewest bytes moved)."""
    return _C.plan_sp_mesh(sp, q_heads, kv_heads, seq_len, head_dim, batch, elem_bytes)


__all__ = [
    "DistributedAttention",
    "StepContext",
    "local_attention",
    "all_gather_sequence",
    "all_reduce_gradients",
    "autosp",
    "flash_attention",
    "gather_head_parts",
    "gather_heads",
    "gather_projected",
    "mark_sequence",
    "plan",
    "plan_sp_mesh",
    "project_from_head_parts",
    "project_head_parts",
    "rebuild_mask",
    "reduce_scatter_sequence",
    "scatter_head_parts",
    "scatter_heads",
    "scatter_projected",
    "sequence_lengths",
    "shard_sequence",
    "sum_over_group",
]
