"""What the AutoSP rewrite says about a graph: which dim holds this rank's tokens (Shard), the
error it raises, and where a node comes from."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch.fx.node import map_arg

# The attribute mark_sequence sets on a marked input: the dim holding the sequence.
MARK = "_ulysses_autosp_dim"


class AutoSPError(ValueError):
    """A graph AutoSP cannot make sequence-parallel exactly."""


@dataclass(frozen=True)
class Shard:
    """A tensor dim holding this rank's tokens: full size ``outer * S * inner``, row-major, so
    a dim that merged batch and sequence (``[B * S, V]``) is still sharded exactly."""

    dim: int
    outer: int = 1
    inner: int = 1

    def size(self, seq_len: int) -> int:
        return self.outer * seq_len * self.inner


def meta(node: fx.Node) -> dict:
    # Source locations only: the original's example values hold full-sequence shapes.
    return {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")}


def nodes(args) -> list[fx.Node]:
    found: list[fx.Node] = []
    map_arg(args, found.append)
    return found


def reduces_all(node: fx.Node) -> bool:
    return len(node.args) == 1 and not set(node.kwargs) - {"dtype"}


def where(node: fx.Node, problem: str) -> str:
    trace = [line.strip() for line in node.meta.get("stack_trace", "").splitlines()
             if line.strip() and set(line.strip()) - set("^~")]
    origin = f" ({trace[-2]}: {trace[-1]})" if len(trace) >= 2 else ""
    return f"node {node.name!r} ({node.format_node()}){origin} {problem}"
