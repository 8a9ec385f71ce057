"""Real c10d Gloo process groups whose ranks are threads of this process.

Used by the C++ tests (through an embedded interpreter) and by the Python tests. Each rank's
ProcessGroup is registered under its own name, which C++ resolves with
c10d::resolve_process_group, exactly as for groups made by torch.distributed.new_group.
"""

from __future__ import annotations

import datetime
import itertools
import threading

import torch
import torch.distributed as dist

_serial = itertools.count()


def make_thread_groups(size: int, timeout_s: float = 30.0) -> tuple[list[str], list[object]]:
    """Creates `size` Gloo ranks meeting through one HashStore, on 127.0.0.1.

    Returns the group names and the ProcessGroup objects (c10d's registry holds them weakly:
    keep them alive while the names are in use).
    """
    tag = f"thread_groups_{next(_serial)}"
    store = dist.PrefixStore(tag, dist.HashStore())
    names = [f"{tag}/{r}" for r in range(size)]
    groups: list[object] = [None] * size
    errors: list[BaseException] = []
    timeout = datetime.timedelta(seconds=timeout_s)
    gloo = dist.ProcessGroup.BackendType.GLOO

    def make(rank: int) -> None:
        try:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            backend = dist.ProcessGroupGloo(store, rank, size, options)
            pg = dist.ProcessGroup(store, rank, size)
            pg._set_default_backend(gloo)
            pg._register_backend(torch.device("cpu"), gloo, backend)
            pg._set_group_name(names[rank])
            torch._C._distributed_c10d._register_process_group(names[rank], pg)
            groups[rank] = pg
        except BaseException as e:  # noqa: BLE001 - reported below, on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return names, groups


def release(names: list[str]) -> None:
    """Drops the registry entries of `names`."""
    for name in names:
        torch._C._distributed_c10d._unregister_process_group(name)
