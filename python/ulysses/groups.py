"""Process groups as the library's ops take them: a group's c10d name (as torch's functional
collectives do), its options as the ops' integer list, and the CPU backend an accelerator-only
group gets for each call's agreement. Every Python module reaches the group plumbing here.

Note [One wait]: every public ``timeout=`` takes a ``datetime.timedelta`` or a number of seconds
(an int or a float alike) and is read once, where it enters, by :func:`wait`; from there only a
:class:`Wait` travels (whole milliseconds, or the group's own), so no function takes a bare
number whose unit would depend on its Python type (``30`` was once 30 ms on some paths).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import numbers
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import GroupName

from . import _C

# A process group, its c10d name, a 1-D DeviceMesh (``mesh["sp"]``), a mesh dimension
# ``(mesh, "sp")``, or None for the default group.
GroupLike = str | dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, int | str] | None
# A collective's longest wait as users give it: a timedelta or a number of seconds (int or
# float); None: the group's own (the timeout its backends were made with: init_process_group's,
# new_group's, NCCL's). Note [One wait].
Timeout = datetime.timedelta | int | float | None
# The wait of a group whose backends show none (kDefaultTimeout).
DEFAULT_TIMEOUT = datetime.timedelta(milliseconds=_C.DEFAULT_TIMEOUT_MS)


@dataclasses.dataclass(frozen=True)
class Wait:
    """A collective's longest wait once read (:func:`wait`): whole milliseconds (> 0), or None
    for the group's own. The one form a wait travels in inside the library (Note [One wait])."""

    ms: int | None = None

    def code(self) -> int:
        """The ops' encoding (``group_options[0]``, the ``timeout_ms`` of ``_C``'s helpers):
        milliseconds, or -1 for the group's own."""
        return -1 if self.ms is None else self.ms

    @staticmethod
    def of_code(code: int) -> Wait:
        """The Wait :meth:`code` encoded."""
        return Wait(None if code < 0 else code)

    def options(self) -> list[int]:
        """The ops' ``int[] group_options``: its prefix ``[timeout]``, the rest left at the C++
        defaults (the codec's home is src/transport/op_options.h)."""
        return [self.code()]


def wait(timeout: Timeout | Wait) -> Wait:
    """Reads a public ``timeout=``: a timedelta or a number of seconds (int or float), None for
    the group's own; a Wait passes through. Anything else is refused (TypeError), and so is a
    wait that is not a finite number of seconds > 0 (ValueError)."""
    if isinstance(timeout, Wait):
        return timeout
    if timeout is None:
        return Wait()
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"ulysses: timeout must be a datetime.timedelta or a number of seconds (int or float), "
                        f"or None for the group's own; got {timeout!r} ({type(timeout).__name__})")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"ulysses: timeout must be a finite number of seconds > 0; got {seconds}")
    return Wait(max(1, round(seconds * 1000)))


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


def with_cpu_backend(name: str, timeout: Timeout | Wait = None) -> None:
    """Gives the group ``name`` a Gloo backend for CPU tensors when it has none (a group made
    NCCL-only), so that each call's agreement moves its few integers host to host instead of
    through the GPU with a device-to-host copy (Note [Metadata device] in group.cpp). The Gloo
    backend rendezvouses through the group's own store, under a prefix of ours, among the
    group's ranks alone: every rank of the group calls this at the same point (the
    DistributedAttention constructor does). A group made with ``"cpu:gloo,cuda:nccl"`` (and
    DeviceMesh groups under such a world) already has one.

    Its timeout is the longer of ``timeout`` (the caller's; None: the group's own) and the
    group's own backends' (NCCL's default is 10 minutes), raised by a later caller's longer one:
    a rank late by less than the job allows (a checkpoint, an evaluation, a first compile) must
    not end the job here. The group keeps its name and description: registering a backend
    clears them (c10d reads the name from one backend, and the new one has none), and an
    unnamed group would read as this rank alone."""
    if not name:
        return
    pg = process_group(name)
    asked, own = wait(timeout).ms, _backend_timeout(pg)
    longest = max(datetime.timedelta(milliseconds=asked or 0), own or DEFAULT_TIMEOUT)
    if (ours := _side_backends.get(pg)) is not None:
        if ours.options._timeout < longest:
            ours.set_timeout(longest)
        return
    if any(d.type == "cpu" for d in pg._device_types):
        return
    store = dist.distributed_c10d._world.pg_map[pg][1]
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("ulysses/cpu/", store), pg.rank(), pg.size(), longest)
    description = pg.group_desc
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_group_name(GroupName(name))
    pg._set_group_desc(description)
    _side_backends[pg] = gloo


def process_group(name: str) -> dist.ProcessGroup:
    """The live c10d process group registered under ``name``."""
    return torch._C._distributed_c10d._resolve_process_group(GroupName(name))


def group_options(timeout: Timeout | Wait) -> list[int]:
    """The ops' ``int[] group_options`` for a public timeout or a Wait (:meth:`Wait.options`)."""
    return wait(timeout).options()


def rank_and_size(name: str) -> tuple[int, int]:
    """This rank's index in the group ``name`` and the group's size ((0, 1) for "")."""
    if not name:  # This rank alone.
        return 0, 1
    pg = process_group(name)
    return pg.rank(), pg.size()


__all__ = ["DEFAULT_TIMEOUT", "GroupLike", "Timeout", "Wait", "group_name", "group_options", "process_group",
           "rank_and_size", "wait", "with_cpu_backend"]
