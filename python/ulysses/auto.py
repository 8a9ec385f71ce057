"""``ulysses.autosp``: Ulysses sequence parallelism for unmodified models through torch.compile.

    ulysses.mark_sequence(input_ids, dim=1)          # every rank passes the same full batch
    compiled = torch.compile(model, backend=ulysses.autosp(group), fullgraph=True)
    loss = compiled(input_ids, attention_mask=mask, labels=labels)
    loss.backward(); ulysses.all_reduce_gradients(model, group)

The backend rewrites the graph Dynamo captured from a single-device model:

- a marked input keeps only this rank's tokens (``SequencePartition::even``, uneven S allowed);
  everything computed from it is *sharded*; everything else (position ids built with
  ``arange``, RoPE tables, masks built from a padding mask, labels) stays *replicated*, full
  and global, and is narrowed to this rank's tokens where it meets a sharded tensor in a
  pointwise op (or as a loss target), *after* whatever the model did to it (a label shift
  stays exact at shard boundaries);
- every ``F.scaled_dot_product_attention`` over sharded q/k/v becomes ``scatter_heads`` (one
  all-to-all for q, k and v; head counts read from that call's q and k) -> ``rebuild_mask`` ->
  local attention -> ``gather_heads``. A mask used by several calls is rebuilt once; a
  key-sharded mask is an error;
- a token mean (``cross_entropy``/``nll_loss`` with ``reduction="mean"``, ``Tensor.mean()``) over
  sharded tokens becomes the exact global mean: local sum and count, summed over the group.
  Gradients are each rank's part of the total; sum them over the group.

Which dim of a tensor is sharded is not guessed from sizes: each node runs twice on fake
tensors, once with the full sequence and once with a shorter one, and the dims that change are
the sharded ones (a dim may merge the sequence with others, e.g. ``[B * S, V]`` logits). An op
that mixes tokens across ranks any other way (indexing one token, a shift along the sharded
dim, a reduction over it) is an error naming the node, raised alike on every rank.

The graph is specialised per input shape at its first call; SP size 1 leaves it untouched.
The forward must be one graph: a graph break (e.g. a data-dependent ``if``) would hand sharded
tensors to the next graph as if they were whole, so it is an error naming the break, raised on
every rank alike; ``fullgraph=True`` makes Dynamo report it where it happens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from . import _C
from . import groups as G
from ._autosp.graph import MARK, AutoSPError, Shard
from ._autosp.rewriter import Rewriter, signature

_log = logging.getLogger("ulysses.autosp")


def mark_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Marks ``tensor``'s ``dim`` as the sequence to shard (``input_ids``: dim 1; a 4-D
    ``[B, H, S, S]`` mask: dim -2, its query rows). Pass the full tensor on every rank; the
    compiled graph keeps this rank's tokens. Returns ``tensor``."""
    setattr(tensor, MARK, dim % tensor.dim())
    return tensor


def autosp(group: G.GroupLike = None, *, inner: str | Callable | None = None, debug: bool = False,
           timeout: G.Timeout = None) -> AutoSP:
    """A ``torch.compile`` backend making the model sequence-parallel over ``group``.

    ``inner``: the backend that compiles the rewritten graph (None: run it eagerly; e.g.
    ``"aot_eager"``, ``"inductor"``). ``debug``: log each graph before and after, with every
    inserted op, at INFO on the ``ulysses.autosp`` logger (configure logging to see it).
    ``timeout``: a timedelta or a number of seconds; None: the group's own (Note [One wait])."""
    return AutoSP(group, inner=inner, debug=debug, timeout=timeout)


class AutoSP:
    """The backend: one per SP group; graphs it rewrote are in ``graphs`` (for inspection)."""

    def __init__(self, group: G.GroupLike = None, *, inner: str | Callable | None = None, debug: bool = False,
                 timeout: G.Timeout = None) -> None:
        self.group = G.group_name(group)
        self.rank, self.size = G.rank_and_size(self.group)
        self.wait = G.wait(timeout)
        self.options = self.wait.options()  # The ops' group_options.
        G.with_cpu_backend(self.group, self.wait)  # The agreement's integers stay on the host.
        self.inner, self.debug = inner, debug
        self.graphs: list[fx.GraphModule] = []

    def __repr__(self) -> str:  # Dynamo names the backend in its errors: alike on every rank.
        return f"ulysses.autosp(group={self.group!r}, size={self.size})"

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        if self.size == 1:
            if self.debug:
                _log.info("ulysses.autosp: SP size 1; graph unchanged")
            self.graphs.append(gm)
            return self._compile(gm, example_inputs)
        broken = graph_break()
        if broken:
            message = (f"ulysses.autosp: the forward graph-breaks ({broken}): the next graph would take this "
                       "rank's sharded tensors as whole ones. Remove the break (compile with fullgraph=True "
                       "to have Dynamo point at it)")
            _C.fail_together(message, self.group, self.wait.code())
            raise AutoSPError(message)
        compiled: dict[tuple, Callable] = {}

        def run(*args):
            key = tuple(signature(a) for a in args)
            if key not in compiled:
                self._agree_inputs(key)
                compiled[key] = self._compile(self.rewrite(gm, args), args)
            return compiled[key](*args)

        return run

    def _agree_inputs(self, key: tuple) -> None:
        """Every rank passes the same full batch: one agreement round on the marked inputs'
        shapes (named in the error) and a digest of every input's signature, before any rank
        rewrites the graph, so inputs that differ on one rank fail every rank with one message."""
        values, names = [_C.text_digest(repr(key))], ["the graph inputs' shapes, dtypes and marks"]
        marked = [a for a in key if isinstance(a, tuple) and len(a) == 5 and a[3] is not None]
        for k, (shape, _dtype, _grad, mark, _value) in enumerate(marked[:8]):
            values.append(len(shape))
            names.append(f"the dims of marked input {k}")
            for d, n in enumerate(shape[:8]):
                values.append(int(n))
                sequence = d == mark % len(shape)
                names.append(f"the given sequence split (marked input {k}'s sequence dim {d})" if sequence
                             else f"dim {d} of marked input {k}")
        # The digest goes last: a marked input's shape, when that is what differs, is named first.
        _C.agree_values(values[1:] + values[:1], names[1:] + names[:1], self.group, self.wait.code(),
                        "ulysses.autosp")

    def _compile(self, gm, args):
        if self.inner is None:
            return gm.forward
        from torch._dynamo import lookup_backend

        inner = lookup_backend(self.inner) if isinstance(self.inner, str) else self.inner
        return inner(gm, list(args))

    def rewrite(self, gm: fx.GraphModule, args: Sequence[Any]) -> fx.GraphModule:
        """``gm`` made sequence-parallel for these inputs (full tensors, marked ones included).
        An error is raised on every rank of the group alike."""
        try:
            new = Rewriter(self, gm, args).run()
        except AutoSPError as e:
            # Deterministic on every rank, but one rank's inputs may differ: the agreement
            # round the other ranks' first collective runs makes them fail with this text too.
            _C.fail_together(f"ulysses.autosp: {e}", self.group, self.wait.code())
            raise
        if self.debug:
            _log.info("ulysses.autosp: graph before\n%s\nulysses.autosp: graph after (inserted nodes are "
                      "named ulysses_*)\n%s", gm.print_readable(print_output=False),
                      new.print_readable(print_output=False))
        self.graphs.append(new)
        return new


def graph_break() -> str | None:
    """Where and why the frame Dynamo is compiling breaks, if this graph ends at a graph break or
    resumes after one; None for a whole frame (or outside Dynamo)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is None:
        return None
    reason = getattr(tx.output, "compile_subgraph_reason", None)
    code = tx.f_code.co_name
    if not getattr(reason, "graph_break", False) and not code.startswith("torch_dynamo_resume_in_"):
        return None
    stack = getattr(reason, "user_stack", None) or []
    where = f" at {stack[-1].filename}:{stack[-1].lineno}: {(stack[-1].line or '').strip()}" if stack else ""
    if not getattr(reason, "graph_break", False):
        return f"this graph resumes after a break, in {code}"
    return f"{str(reason.reason).splitlines()[0]}{where}"  # type: ignore[union-attr]


__all__ = ["AutoSP", "AutoSPError", "Shard", "autosp", "mark_sequence"]
