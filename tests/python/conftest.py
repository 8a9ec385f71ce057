"""Shared helpers: ranks as threads over real Gloo groups (tests/thread_groups.py)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import thread_groups  # noqa: E402

import ulysses  # noqa: E402,F401  (registers torch.ops.ulysses)

torch.set_num_threads(1)  # The ranks share the machine's cores.


def _run_threads(world: int, body: Callable[[int, str], object], timeout_s: float):
    """Runs ``body(rank, group_name)`` on ``world`` thread ranks with real Gloo groups; returns
    each rank's result and exception (None where it finished cleanly)."""
    names, groups = thread_groups.make_thread_groups(world, timeout_s)
    results: list = [None] * world
    errors: list = [None] * world

    def run(r: int) -> None:
        try:
            results[r] = body(r, names[r])
        except BaseException as e:  # noqa: BLE001 - reported by the callers
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    thread_groups.release(names)
    del groups
    return results, errors


def run_ranks(world: int, body: Callable[[int, str], object], timeout_s: float = 30.0) -> list:
    """Runs ``body(rank, group_name)`` on ``world`` thread ranks; returns results, raises the
    first rank's error (with its rank) if any rank failed."""
    results, errors = _run_threads(world, body, timeout_s)
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r} of {world} failed: {e!r}") from e
    return results


def run_ranks_errors(world: int, body: Callable[[int, str], object], timeout_s: float = 30.0) -> list[str]:
    """Like run_ranks, but returns each rank's error message ('' for a clean finish)."""
    _, errors = _run_threads(world, body, timeout_s)
    return ["" if e is None else f"{type(e).__name__}: {e}" for e in errors]


def _process_rank(rank, world, store, body, args, result_dir):
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.save(body(rank, dist.group.WORLD.group_name, *args), os.path.join(result_dir, str(rank)))
    finally:
        dist.destroy_process_group()


def run_processes(world: int, body: Callable, *args, tmp_dir: str) -> list:
    """Runs ``body(rank, group_name, *args)`` on ``world`` processes (spawned, one Gloo world
    through a FileStore in ``tmp_dir``); ``body`` must be a module-level function. Returns each
    rank's result; a failing rank fails the call."""
    import torch.multiprocessing as mp

    mp.start_processes(_process_rank, args=(world, os.path.join(tmp_dir, "store"), body, args, tmp_dir),
                       nprocs=world, start_method="spawn")
    return [torch.load(os.path.join(tmp_dir, str(r)), weights_only=False) for r in range(world)]


def run_example(script: str, nproc: int, *args: str, timeout_s: float = 240):
    """examples/``script`` under torchrun on ``nproc`` local ranks (a free loopback port, one
    thread each); returns the completed process."""
    import socket
    import subprocess

    with socket.socket() as s:  # a free loopback port for torchrun's store
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", port, os.path.join(root, "examples", script), *args],
                          capture_output=True, text=True, env=env, timeout=timeout_s)


def set_up_links(group: str, P: int) -> None:
    """One tiny exchange on every rank of ``group``: its first sets up the group's shared-memory
    links (two all_gathers), so that a count of collectives after it holds no one-time set-up."""
    ulysses.scatter_heads([torch.zeros(1, 1, P, 1)], ["q"], P, P, [1] * P, group=group)


def seq_lens(S: int, P: int) -> list[int]:
    return [S // P + (r < S % P) for r in range(P)]


def shard(x: torch.Tensor, dim: int, rank: int, lens: list[int]) -> torch.Tensor:
    start = sum(lens[:rank])
    return x.narrow(dim, start, lens[rank])


@pytest.fixture
def ranks():
    return run_ranks
