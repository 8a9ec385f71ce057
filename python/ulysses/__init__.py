"""Ulysses sequence parallelism for transformer attention (C++ core, PyTorch front end).

Loading the package registers the ``torch.ops.ulysses`` operators (and their fake kernels,
``ulysses.fake_kernels``). Its names, by module:

- ``ulysses.attention``: DistributedAttention, StepContext (the module and its per-step cache).
- ``ulysses.ops``: all_gather_sequence, flash_attention, gather_head_parts, gather_heads,
  gather_projected, local_attention, local_kernel, project_from_head_parts, project_head_parts,
  rebuild_mask,
  reduce_scatter_sequence, scatter_head_parts, scatter_heads, scatter_projected,
  sequence_lengths, sum_over_group (the functional ops).
- ``ulysses.groups``: GroupLike, group_name, with_cpu_backend (process groups as the ops take
  them).
- ``ulysses.plans``: plan, plan_sp_mesh (the pure planners).
- ``ulysses.training``: all_reduce_gradients, shard_sequence (the training helpers; also
  shard_batch, sequence_parallel_loss and token_mean, which ``ulysses.hf`` re-exports).
- ``ulysses.auto``: autosp, mark_sequence (AutoSP, loaded on first use).
"""

from __future__ import annotations

from importlib import metadata as _metadata

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _environment  # noqa: F401  (refuses another torch or a clashing package first)

# isort: split
from . import (
    _C,
    fake_kernels,  # noqa: F401  (registers the ops' fake kernels)
)
from .attention import DistributedAttention, StepContext
from .ops import (
    all_gather_sequence,
    flash_attention,
    gather_head_parts,
    gather_heads,
    gather_projected,
    local_attention,
    local_kernel,
    project_from_head_parts,
    project_head_parts,
    rebuild_mask,
    reduce_scatter_sequence,
    scatter_head_parts,
    scatter_heads,
    scatter_projected,
    sequence_lengths,
    sum_over_group,
)
from .plans import plan, plan_sp_mesh
from .training import all_reduce_gradients, shard_sequence

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

__all__ = [
    # ulysses.attention
    "DistributedAttention", "StepContext",
    # ulysses.ops
    "all_gather_sequence", "flash_attention", "gather_head_parts", "gather_heads", "gather_projected",
    "local_attention", "local_kernel", "project_from_head_parts", "project_head_parts", "rebuild_mask",
    "reduce_scatter_sequence", "scatter_head_parts", "scatter_heads", "scatter_projected", "sequence_lengths",
    "sum_over_group",
    # ulysses.plans
    "plan", "plan_sp_mesh",
    # ulysses.training
    "all_reduce_gradients", "shard_sequence",
    # ulysses.auto
    "autosp", "mark_sequence",
]
