"""The ``ulysses`` command: ``ulysses train|plan|demo|bench|launch`` (``ulysses --help``).

The subcommands are C++ (tools/ and bench/, in the module ``ulysses._cli``); this front end
owns the process groups: it joins the world
described by torchrun's environment through ``torch.distributed.init_process_group`` (so under
torchrun's default rendezvous every rank joins the agent's store as a client) and creates the
mesh's sub-groups with ``new_subgroups_by_enumeration``; C++ resolves them by name.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from . import _cli


def _join_world(timeout_ms: int) -> str:
    """Joins torchrun's world; ``timeout_ms``: the --timeout in milliseconds (-1: torch's default)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return ""  # A world of one rank: no process group needed.
    if not dist.is_initialized():
        timeout = datetime.timedelta(milliseconds=timeout_ms) if timeout_ms > 0 else None
        dist.init_process_group("gloo", timeout=timeout)
    assert dist.group.WORLD is not None
    return dist.group.WORLD.group_name


def _split(partition: list[list[int]]) -> str:
    mine, _ = dist.new_subgroups_by_enumeration(partition, backend="gloo")
    return mine.group_name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = _cli.run_cli(argv, [sys.executable, "-m", "ulysses"], _join_world, _split)
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
