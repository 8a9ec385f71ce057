"""Process groups as the library's ops take them: a group's c10d name (as torch's functional
collectives do), its options as the ops' integer list, and the CPU backend an accelerator-only
group gets for each call's agreement. Every Python module reaches the group plumbing here.
"""

from __future__ import annotations

import datetime
import weakref

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


def group_options(timeout: Timeout | int) -> list[int]:
    """The ops' ``int[] group_options`` for a timeout (a timedelta, seconds, or None; an int is
    milliseconds already): its prefix ``[timeout ms]``, the rest left at the C++ defaults. The
    codec's home is src/transport/op_options.h; this is its one writer in Python."""
    return [timeout if isinstance(timeout, int) else timeout_ms(timeout)]


def rank_and_size(name: str) -> tuple[int, int]:
    """This rank's index in the group ``name`` and the group's size ((0, 1) for "")."""
    if not name:  # This rank alone.
        return 0, 1
    pg = process_group(name)
    return pg.rank(), pg.size()


__all__ = ["DEFAULT_TIMEOUT", "GroupLike", "Timeout", "group_name", "group_options", "process_group",
           "rank_and_size", "timeout_ms", "with_cpu_backend"]
