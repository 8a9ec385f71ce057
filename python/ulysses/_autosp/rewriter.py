"""The AutoSP rewrite: one pass over the graph Dynamo captured, building the sequence-parallel
one node by node (``ulysses.auto``'s module docstring says what it does)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_arg

from .. import _C
from . import handlers
from .graph import MARK, AutoSPError, Shard, meta, nodes, reduces_all, where
from .op_tables import ALONG_DIM, CONVOLUTIONS, LOSSES, RESHAPES, SDPA, SHAPE_QUERIES, SYM_QUERIES, is_pointwise


def signature(a: Any) -> Any:
    """What a specialisation depends on: shapes, dtypes, marks, and the value of 0-d CPU
    tensors (Dynamo passes Python floats it made dynamic, e.g. a module's attention scale, as
    such tensors; the rewrite reads them)."""
    if not isinstance(a, torch.Tensor):
        return a
    value = a.item() if a.dim() == 0 and a.device.type == "cpu" and not a.requires_grad else None
    return tuple(a.shape), a.dtype, a.requires_grad, getattr(a, MARK, None), value


class Rewriter:
    """One pass over the original graph, building the sequence-parallel one node by node.

    Every node of the new graph carries its value on fake tensors with the full sequence
    (``full``: what the original graph computes there) and with a probe length (probe_len) != S standing
    in for this rank's tokens (``probe``), and which dim, if any, is sharded (``shard``)."""

    def __init__(self, owner: Any, gm: fx.GraphModule, args: Sequence[Any]) -> None:  # owner: an AutoSP
        self.owner, self.gm, self.args = owner, gm, list(args)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.graph = fx.Graph()
        self.new: dict[fx.Node, Any] = {}  # Original node -> new node (or a constant).
        self.full: dict[fx.Node, Any] = {}
        self.probe: dict[fx.Node, Any] = {}
        self.shard: dict[fx.Node, Shard | None] = {}
        self.rebuilt_masks: dict[tuple, fx.Node] = {}
        self.cuts: dict[tuple, fx.Node] = {}
        self.scalars: dict[fx.Node, torch.Tensor] = {}  # 0-d inputs, whose .item() is read
        self.trace = ""  # Stack trace of the node being rewritten, for the nodes inserted for it.
        lengths = {a.shape[getattr(a, MARK)] for a in args
                   if isinstance(a, torch.Tensor) and hasattr(a, MARK)}
        if not lengths:
            raise AutoSPError("no input is marked as sharded along the sequence; call "
                              "ulysses.mark_sequence(input_ids, dim=1) before the compiled call")
        if len(lengths) > 1:
            raise AutoSPError(f"marked inputs disagree on the sequence length: {sorted(lengths)}")
        self.S = lengths.pop()
        self.seq_lens = _C.sequence_split(self.S, owner.size)
        self.offset = sum(self.seq_lens[:owner.rank])
        self.local_len = self.seq_lens[owner.rank]
        # The probe length differs from S on every rank alike, so every rank decides alike.
        self.probe_len = max(self.seq_lens) if max(self.seq_lens) < self.S else 0

    # ---- the pass -----------------------------------------------------------------------------

    def run(self) -> fx.GraphModule:
        placeholders = iter(self.args)
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node, next(placeholders))
            elif node.op == "output":
                self.graph.output(map_arg(node.args[0], lambda n: self.new[n]))
            elif node.op == "get_attr":
                new = self.new[node] = self.graph.get_attr(node.target)
                self.record(new, self._fake(getattr(self.gm, node.target)))
            else:
                self._call(node)
        self.graph.eliminate_dead_code()  # e.g. kv head copies no longer used
        self.graph.lint()
        return fx.GraphModule(self.gm, self.graph)

    def _placeholder(self, node: fx.Node, value: Any) -> None:
        new = self.graph.placeholder(node.name)
        new.meta = meta(node)
        fake = self._fake(value)
        self.record(new, fake)
        self.new[node] = new
        if isinstance(value, torch.Tensor) and signature(value)[-1] is not None:
            self.scalars[new] = value
        dim = getattr(value, MARK, None) if isinstance(value, torch.Tensor) else None
        if dim is not None:
            self.new[node] = self.narrow(new, Shard(dim))

    def _call(self, node: fx.Node) -> None:
        self.trace = node.meta.get("stack_trace", "")
        args: Any = map_arg((node.args, node.kwargs), lambda n: self.new[n])
        if node.op == "call_method" and node.target == "item" and args[0][0] in self.scalars:
            self.new[node] = self.scalars[args[0][0]].item()  # A dynamic Python scalar's value.
            return
        try:
            full = self._execute(node, *map_arg((node.args, node.kwargs), lambda n: self._full(n)))
        except Exception as e:  # noqa: BLE001 - e.g. .item() of a computed tensor.
            raise AutoSPError(where(node, "cannot be evaluated from shapes alone "
                                     f"({type(e).__name__}: {str(e).splitlines()[0]})")) from None
        if not any(self._is_sharded(n) for n in nodes(args)):
            self._copy(node, args, full)
            return
        self._refuse_mixing(node, args)
        if node.target is SDPA:
            handlers.attention(self, node, args, full)
        elif node.target in LOSSES:
            handlers.loss(self, node, args, full)
        elif (node.op == "call_method" and node.target in SHAPE_QUERIES) or node.target in SYM_QUERIES:
            self.new[node] = full  # The model asks for the full sequence's shape.
        elif node.op == "call_method" and node.target in ("mean", "sum") and reduces_all(node):
            handlers.global_sum(self, node, args, full)
        elif node.op == "call_method" and node.target in RESHAPES:
            self._copy(node, self._reshape_args(node, args, full, self.local_len), full,
                       self._reshape_args(node, args, full, self.probe_len))
        elif node.op == "call_method" and node.target == "expand":
            self._copy(node, self._expand_args(args), full)
        else:
            self._copy(node, self._narrowed_args(node, args) if is_pointwise(node) else args, full)

    def _refuse_mixing(self, node: fx.Node, args: tuple) -> None:
        """Ops that keep the sharded dim's size but combine tokens along it are errors."""
        src = args[0][0] if args[0] else None
        s = self.shard.get(src) if isinstance(src, fx.Node) else None
        if s is None or not isinstance(src, fx.Node):
            return
        name: Any = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.target in CONVOLUTIONS and s.dim >= 2:
            raise AutoSPError(where(node, "convolves along the sharded sequence dim"))
        if name not in ALONG_DIM:
            return
        position, default = ALONG_DIM[name]
        dims = args[1].get("dim", args[1].get("dims", args[0][position] if len(args[0]) > position
                                               else default))
        ndim = self.full[src].dim()
        dims = range(ndim) if dims is None else [dims] if isinstance(dims, int) else dims
        if s.dim in [d % ndim for d in dims]:
            raise AutoSPError(where(node, f"mixes tokens along the sharded sequence dim {s.dim} "
                                     f"({name}); each rank holds only its own tokens there"))

    # ---- generic nodes ------------------------------------------------------------------------

    def _copy(self, node: fx.Node, args: tuple, full: Any, probe_args: tuple | None = None) -> None:
        """The node over new ``args``; its shard is found by comparing probe and full values
        (``probe_args``: the args for the probe length where sizes are spelled out)."""
        new = self.graph.create_node(node.op, node.target, args[0], args[1], name=node.name)
        new.meta = meta(node)
        self.new[node] = new
        probe_args = probe_args or args
        if not any(self._is_sharded(n) for n in nodes(probe_args)):
            self.record(new, full)  # Over full inputs alone the probe run is the full run.
            return
        try:
            probe = self._execute(node, *map_arg(probe_args, lambda n: self.probe[n]))
        except Exception as e:  # noqa: BLE001 - any failure means the op mixes shards.
            raise AutoSPError(where(node, "cannot run on this rank's tokens alone "
                                     f"({type(e).__name__}: {str(e).splitlines()[0]})")) from None
        self.record(new, full, probe, self._shard_of(node, args, full, probe))

    def _shard_of(self, node: fx.Node, args: tuple, full: Any, probe: Any) -> Shard | None:
        if not isinstance(full, torch.Tensor):
            return None
        changed = [d for d in range(full.dim()) if full.shape[d] != probe.shape[d]]
        inputs = [s for n in nodes(args) if (s := self.shard.get(n)) is not None]
        if not changed:
            if inputs and not (node.op == "call_method" and str(node.target).startswith("new_")):
                raise AutoSPError(where(node, "reduces over or indexes into the sharded sequence "
                                         "dim (its result would depend on other ranks' tokens)"))
            return None
        if len(changed) > 1:
            raise AutoSPError(where(node, f"has the sequence in dims {changed} at once "
                                     "(attention written out by hand? use "
                                     "F.scaled_dot_product_attention)"))
        d = changed[0]
        k, rest = divmod(full.shape[d], self.S)
        if rest or probe.shape[d] != k * self.probe_len:
            raise AutoSPError(where(node, f"changes the length of the sharded sequence dim {d} "
                                     "(a shift or pad along it?); leave such inputs unmarked: "
                                     "replicated tensors are cut where they meet sharded ones"))
        for s in inputs:  # A dim that merged batch and sequence keeps its (outer, inner) split.
            if s.outer * s.inner == k:
                return Shard(d, s.outer, s.inner)
        return Shard(d, k, 1)

    def _narrowed_args(self, node: fx.Node, args: tuple) -> tuple:
        """Args of a pointwise node with its replicated operands cut to this rank's tokens
        along the dim that broadcasts against a sharded operand."""
        ref = next(n for n in nodes(args) if self.shard.get(n) is not None)
        s, ref_dim = self._sharded(ref), self.full[ref].dim()
        same_dims = node.target in (torch.cat, torch.stack, torch.concat)

        def cut(n: fx.Node):
            value = self.full[n]
            if self.shard[n] is not None or not isinstance(value, torch.Tensor):
                return n
            d = s.dim if same_dims else s.dim - (ref_dim - value.dim())
            if not 0 <= d < value.dim() or value.shape[d] != s.size(self.S):
                return n  # No sequence dim there, or a broadcast one.
            return self.narrow(n, Shard(d, s.outer, s.inner))

        return map_arg(args, cut)

    def narrow(self, n: fx.Node, s: Shard) -> fx.Node:
        """The cut of a full tensor ``n`` to this rank's tokens along ``s`` (inserted once)."""
        if (n, s) in self.cuts:
            return self.cuts[(n, s)]
        if s.outer == s.inner == 1:
            cut = self.insert(torch.narrow, (n, s.dim, self.offset, self.local_len))
        else:
            split = self.insert(torch.unflatten, (n, s.dim, (s.outer, self.S, s.inner)))
            part = self.insert(torch.narrow, (split, s.dim + 1, self.offset, self.local_len))
            cut = self.insert(torch.flatten, (part, s.dim, s.dim + 2))
        full = self.full[n]
        with self.mode:
            probe = full.unflatten(s.dim, (s.outer, self.S, s.inner)).narrow(s.dim + 1, 0, self.probe_len)
            self.record(cut, full, probe.flatten(s.dim, s.dim + 2), s)
        self.cuts[(n, s)] = cut
        return cut

    def _reshape_args(self, node: fx.Node, args: tuple, full: torch.Tensor, length: int) -> tuple:
        """view/reshape of a sharded tensor: the sequence lands in the output dim holding its
        flat index range, whose size becomes the one for ``length`` tokens."""
        src = args[0][0]
        s, shape, out = self._sharded(src), list(self.full[src].shape), list(full.shape)
        before = math.prod(shape[:s.dim]) * s.outer
        for d in range(len(out)):
            lead, upto = math.prod(out[:d]), math.prod(out[:d + 1])
            if before % lead == 0 and upto % (before * self.S) == 0:
                out[d] = Shard(d, before // lead, upto // (before * self.S)).size(length)
                return (src, *out), {}
        raise AutoSPError(where(node, f"splits the sequence dim of {shape} into {list(full.shape)}"))

    def _expand_args(self, args: tuple) -> tuple:
        src, *sizes = args[0]
        if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = list(sizes[0])
        sizes[len(sizes) - self.full[src].dim() + self._sharded(src).dim] = -1  # Keep local length.
        return (src, *sizes), args[1]






    # ---- helpers ------------------------------------------------------------------------------

    def insert(self, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        name = "ulysses_" + getattr(target, "__name__", "op").split(".")[-1]
        new = self.graph.create_node("call_function", target, args, kwargs or {}, name=name)
        new.meta["stack_trace"] = self.trace
        return new

    def record(self, new: fx.Node, full: Any, probe: Any = None, shard: Shard | None = None):
        self.full[new], self.probe[new], self.shard[new] = full, full if probe is None else probe, shard

    def _sharded(self, n: fx.Node) -> Shard:
        """The shard of a node known to be sharded."""
        s = self.shard.get(n)
        assert s is not None, n
        return s

    def _full(self, original: fx.Node) -> Any:
        new = self.new[original]
        return self.full[new] if isinstance(new, fx.Node) else new

    def _is_sharded(self, n: fx.Node) -> bool:
        if self.shard.get(n) is not None:
            return True
        full, probe = self.full.get(n), self.probe.get(n)
        if isinstance(full, (tuple, list)):  # A tuple of tensors (split, chunk).
            return any(isinstance(f, torch.Tensor) and f.shape != p.shape for f, p in zip(full, probe or ()))
        return False

    def _fake(self, value):
        return self.mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    def _execute(self, node: fx.Node, args, kwargs):
        target: Any = node.target  # A method or module name, or a callable.
        with self.mode:
            if node.op == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            if node.op == "call_module":
                return self.gm.get_submodule(target)(*args, **kwargs)
            return target(*args, **kwargs)
