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

import inspect
import logging
import math
import operator
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_arg

from . import _C
from . import groups as G

_log = logging.getLogger("ulysses.autosp")

_MARK = "_ulysses_autosp_dim"
_SDPA = torch._C._nn.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_LOSSES: dict[Any, inspect.Signature] = {F.cross_entropy: inspect.signature(F.cross_entropy),
           F.nll_loss: inspect.signature(F.nll_loss)}
# Shape-only queries of a sharded tensor answer for the full sequence, as the model expects.
_SHAPE_QUERIES = {"size", "numel"}
_SYM_QUERIES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default}
_RESHAPES = {"view", "reshape"}
# Ops that mix values along a dim while keeping its size: name -> (position of that dim
# argument, default). On the sharded dim they would see this rank's tokens only.
_ALONG_DIM = {"roll": (2, None), "flip": (1, None), "cumsum": (1, None), "cumprod": (1, None),
              "cummax": (1, None), "cummin": (1, None), "logcumsumexp": (1, None),
              "softmax": (1, None), "log_softmax": (1, None), "sort": (1, -1), "argsort": (1, -1),
              "topk": (2, -1), "diff": (2, -1)}
_CONVOLUTIONS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                 F.conv_transpose3d}
_OPERATOR_ATEN = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "floordiv": "floor_divide",
                  "mod": "remainder", "pow": "pow", "and_": "bitwise_and", "or_": "bitwise_or",
                  "xor": "bitwise_xor", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt",
                  "ge": "ge", "neg": "neg", "invert": "bitwise_not", "iadd": "add", "imul": "mul"}


class AutoSPError(ValueError):
    """A graph AutoSP cannot make sequence-parallel exactly."""


def mark_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Marks ``tensor``'s ``dim`` as the sequence to shard (``input_ids``: dim 1; a 4-D
    ``[B, H, S, S]`` mask: dim -2, its query rows). Pass the full tensor on every rank; the
    compiled graph keeps this rank's tokens. Returns ``tensor``."""
    setattr(tensor, _MARK, dim % tensor.dim())
    return tensor


@dataclass(frozen=True)
class Shard:
    """A tensor dim holding this rank's tokens: full size ``outer * S * inner``, row-major, so
    a dim that merged batch and sequence (``[B * S, V]``) is still sharded exactly."""

    dim: int
    outer: int = 1
    inner: int = 1

    def size(self, seq_len: int) -> int:
        return self.outer * seq_len * self.inner


def autosp(group: G.GroupLike = None, *, inner: str | Callable | None = None, debug: bool = False,
           timeout: G.Timeout = None) -> AutoSP:
    """A ``torch.compile`` backend making the model sequence-parallel over ``group``.

    ``inner``: the backend that compiles the rewritten graph (None: run it eagerly; e.g.
    ``"aot_eager"``, ``"inductor"``). ``debug``: log each graph before and after, with every
    inserted op, at INFO on the ``ulysses.autosp`` logger (configure logging to see it)."""
    return AutoSP(group, inner=inner, debug=debug, timeout=timeout)


class AutoSP:
    """The backend: one per SP group; graphs it rewrote are in ``graphs`` (for inspection)."""

    def __init__(self, group: G.GroupLike = None, *, inner: str | Callable | None = None, debug: bool = False,
                 timeout: G.Timeout = None) -> None:
        self.group = G.group_name(group)
        self.rank, self.size = G.rank_and_size(self.group)
        self.timeout_ms = G.timeout_ms(timeout)
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
        broken = _graph_break()
        if broken:
            message = (f"ulysses.autosp: the forward graph-breaks ({broken}): the next graph would take this "
                       "rank's sharded tensors as whole ones. Remove the break (compile with fullgraph=True "
                       "to have Dynamo point at it)")
            _C.fail_together(message, self.group, self.timeout_ms)
            raise AutoSPError(message)
        compiled: dict[tuple, Callable] = {}

        def run(*args):
            key = tuple(_signature(a) for a in args)
            if key not in compiled:
                self._agree_inputs(key)
                compiled[key] = self._compile(self.rewrite(gm, args), args)
            return compiled[key](*args)

        return run

    def _agree_inputs(self, key: tuple) -> None:
        """Every rank passes the same full batch: one agreement round on the marked inputs'
        shapes (named in the error) and a digest of every input's signature, before any rank
        rewrites the graph, so inputs that differ on one rank fail every rank with one message."""
        values, names = [zlib.crc32(repr(key).encode())], ["the graph inputs' shapes, dtypes and marks"]
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
        _C.agree_values(values[1:] + values[:1], names[1:] + names[:1], self.group, self.timeout_ms,
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
            new = _Rewriter(self, gm, args).run()
        except AutoSPError as e:
            # Deterministic on every rank, but one rank's inputs may differ: the agreement
            # round the other ranks' first collective runs makes them fail with this text too.
            _C.fail_together(f"ulysses.autosp: {e}", self.group, self.timeout_ms)
            raise
        if self.debug:
            _log.info("ulysses.autosp: graph before\n%s\nulysses.autosp: graph after (inserted nodes are "
                      "named ulysses_*)\n%s", gm.print_readable(print_output=False),
                      new.print_readable(print_output=False))
        self.graphs.append(new)
        return new


def _signature(a: Any) -> Any:
    """What a specialisation depends on: shapes, dtypes, marks, and the value of 0-d CPU
    tensors (Dynamo passes Python floats it made dynamic, e.g. a module's attention scale, as
    such tensors; the rewrite reads them)."""
    if not isinstance(a, torch.Tensor):
        return a
    value = a.item() if a.dim() == 0 and a.device.type == "cpu" and not a.requires_grad else None
    return tuple(a.shape), a.dtype, a.requires_grad, getattr(a, _MARK, None), value


def _is_pointwise(node: fx.Node) -> bool:
    """Broadcasting elementwise ops (by aten's pointwise tag), plus cat/stack (aligned dims)."""
    name: Any
    if node.op == "call_method":
        name = node.target
    elif node.target in (torch.cat, torch.stack, torch.concat):
        return True
    elif getattr(node.target, "__module__", None) == "_operator":
        name = _OPERATOR_ATEN.get(getattr(node.target, "__name__", ""))
    else:
        name = getattr(node.target, "__name__", None)
    packet = getattr(torch.ops.aten, name.rstrip("_") if name else "", None) if name else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


class _Rewriter:
    """One pass over the original graph, building the sequence-parallel one node by node.

    Every node of the new graph carries its value on fake tensors with the full sequence
    (``full``: what the original graph computes there) and with a probe length (probe_len) != S standing
    in for this rank's tokens (``probe``), and which dim, if any, is sharded (``shard``)."""

    def __init__(self, owner: AutoSP, gm: fx.GraphModule, args: Sequence[Any]) -> None:
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
        lengths = {a.shape[getattr(a, _MARK)] for a in args
                   if isinstance(a, torch.Tensor) and hasattr(a, _MARK)}
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
                self._record(new, self._fake(getattr(self.gm, node.target)))
            else:
                self._call(node)
        self.graph.eliminate_dead_code()  # e.g. kv head copies no longer used
        self.graph.lint()
        return fx.GraphModule(self.gm, self.graph)

    def _placeholder(self, node: fx.Node, value: Any) -> None:
        new = self.graph.placeholder(node.name)
        new.meta = _meta(node)
        fake = self._fake(value)
        self._record(new, fake)
        self.new[node] = new
        if isinstance(value, torch.Tensor) and _signature(value)[-1] is not None:
            self.scalars[new] = value
        dim = getattr(value, _MARK, None) if isinstance(value, torch.Tensor) else None
        if dim is not None:
            self.new[node] = self._narrow(new, Shard(dim))

    def _call(self, node: fx.Node) -> None:
        self.trace = node.meta.get("stack_trace", "")
        args: Any = map_arg((node.args, node.kwargs), lambda n: self.new[n])
        if node.op == "call_method" and node.target == "item" and args[0][0] in self.scalars:
            self.new[node] = self.scalars[args[0][0]].item()  # A dynamic Python scalar's value.
            return
        try:
            full = self._execute(node, *map_arg((node.args, node.kwargs), lambda n: self._full(n)))
        except Exception as e:  # noqa: BLE001 - e.g. .item() of a computed tensor.
            raise AutoSPError(_where(node, "cannot be evaluated from shapes alone "
                                     f"({type(e).__name__}: {str(e).splitlines()[0]})")) from None
        if not any(self._is_sharded(n) for n in _nodes(args)):
            self._copy(node, args, full)
            return
        self._refuse_mixing(node, args)
        if node.target is _SDPA:
            self._attention(node, args, full)
        elif node.target in _LOSSES:
            self._loss(node, args, full)
        elif (node.op == "call_method" and node.target in _SHAPE_QUERIES) or node.target in _SYM_QUERIES:
            self.new[node] = full  # The model asks for the full sequence's shape.
        elif node.op == "call_method" and node.target in ("mean", "sum") and _reduces_all(node):
            self._global_sum(node, args, full)
        elif node.op == "call_method" and node.target in _RESHAPES:
            self._copy(node, self._reshape_args(node, args, full, self.local_len), full,
                       self._reshape_args(node, args, full, self.probe_len))
        elif node.op == "call_method" and node.target == "expand":
            self._copy(node, self._expand_args(args), full)
        else:
            self._copy(node, self._narrowed_args(node, args) if _is_pointwise(node) else args, full)

    def _refuse_mixing(self, node: fx.Node, args: tuple) -> None:
        """Ops that keep the sharded dim's size but combine tokens along it are errors."""
        src = args[0][0] if args[0] else None
        s = self.shard.get(src) if isinstance(src, fx.Node) else None
        if s is None or not isinstance(src, fx.Node):
            return
        name: Any = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.target in _CONVOLUTIONS and s.dim >= 2:
            raise AutoSPError(_where(node, "convolves along the sharded sequence dim"))
        if name not in _ALONG_DIM:
            return
        position, default = _ALONG_DIM[name]
        dims = args[1].get("dim", args[1].get("dims", args[0][position] if len(args[0]) > position
                                               else default))
        ndim = self.full[src].dim()
        dims = range(ndim) if dims is None else [dims] if isinstance(dims, int) else dims
        if s.dim in [d % ndim for d in dims]:
            raise AutoSPError(_where(node, f"mixes tokens along the sharded sequence dim {s.dim} "
                                     f"({name}); each rank holds only its own tokens there"))

    # ---- generic nodes ------------------------------------------------------------------------

    def _copy(self, node: fx.Node, args: tuple, full: Any, probe_args: tuple | None = None) -> None:
        """The node over new ``args``; its shard is found by comparing probe and full values
        (``probe_args``: the args for the probe length where sizes are spelled out)."""
        new = self.graph.create_node(node.op, node.target, args[0], args[1], name=node.name)
        new.meta = _meta(node)
        self.new[node] = new
        probe_args = probe_args or args
        if not any(self._is_sharded(n) for n in _nodes(probe_args)):
            self._record(new, full)  # Over full inputs alone the probe run is the full run.
            return
        try:
            probe = self._execute(node, *map_arg(probe_args, lambda n: self.probe[n]))
        except Exception as e:  # noqa: BLE001 - any failure means the op mixes shards.
            raise AutoSPError(_where(node, "cannot run on this rank's tokens alone "
                                     f"({type(e).__name__}: {str(e).splitlines()[0]})")) from None
        self._record(new, full, probe, self._shard_of(node, args, full, probe))

    def _shard_of(self, node: fx.Node, args: tuple, full: Any, probe: Any) -> Shard | None:
        if not isinstance(full, torch.Tensor):
            return None
        changed = [d for d in range(full.dim()) if full.shape[d] != probe.shape[d]]
        inputs = [s for n in _nodes(args) if (s := self.shard.get(n)) is not None]
        if not changed:
            if inputs and not (node.op == "call_method" and str(node.target).startswith("new_")):
                raise AutoSPError(_where(node, "reduces over or indexes into the sharded sequence "
                                         "dim (its result would depend on other ranks' tokens)"))
            return None
        if len(changed) > 1:
            raise AutoSPError(_where(node, f"has the sequence in dims {changed} at once "
                                     "(attention written out by hand? use "
                                     "F.scaled_dot_product_attention)"))
        d = changed[0]
        k, rest = divmod(full.shape[d], self.S)
        if rest or probe.shape[d] != k * self.probe_len:
            raise AutoSPError(_where(node, f"changes the length of the sharded sequence dim {d} "
                                     "(a shift or pad along it?); leave such inputs unmarked: "
                                     "replicated tensors are cut where they meet sharded ones"))
        for s in inputs:  # A dim that merged batch and sequence keeps its (outer, inner) split.
            if s.outer * s.inner == k:
                return Shard(d, s.outer, s.inner)
        return Shard(d, k, 1)

    def _narrowed_args(self, node: fx.Node, args: tuple) -> tuple:
        """Args of a pointwise node with its replicated operands cut to this rank's tokens
        along the dim that broadcasts against a sharded operand."""
        ref = next(n for n in _nodes(args) if self.shard.get(n) is not None)
        s, ref_dim = self._sharded(ref), self.full[ref].dim()
        same_dims = node.target in (torch.cat, torch.stack, torch.concat)

        def cut(n: fx.Node):
            value = self.full[n]
            if self.shard[n] is not None or not isinstance(value, torch.Tensor):
                return n
            d = s.dim if same_dims else s.dim - (ref_dim - value.dim())
            if not 0 <= d < value.dim() or value.shape[d] != s.size(self.S):
                return n  # No sequence dim there, or a broadcast one.
            return self._narrow(n, Shard(d, s.outer, s.inner))

        return map_arg(args, cut)

    def _narrow(self, n: fx.Node, s: Shard) -> fx.Node:
        """The cut of a full tensor ``n`` to this rank's tokens along ``s`` (inserted once)."""
        if (n, s) in self.cuts:
            return self.cuts[(n, s)]
        if s.outer == s.inner == 1:
            cut = self._insert(torch.narrow, (n, s.dim, self.offset, self.local_len))
        else:
            split = self._insert(torch.unflatten, (n, s.dim, (s.outer, self.S, s.inner)))
            part = self._insert(torch.narrow, (split, s.dim + 1, self.offset, self.local_len))
            cut = self._insert(torch.flatten, (part, s.dim, s.dim + 2))
        full = self.full[n]
        with self.mode:
            probe = full.unflatten(s.dim, (s.outer, self.S, s.inner)).narrow(s.dim + 1, 0, self.probe_len)
            self._record(cut, full, probe.flatten(s.dim, s.dim + 2), s)
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
        raise AutoSPError(_where(node, f"splits the sequence dim of {shape} into {list(full.shape)}"))

    def _expand_args(self, args: tuple) -> tuple:
        src, *sizes = args[0]
        if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = list(sizes[0])
        sizes[len(sizes) - self.full[src].dim() + self._sharded(src).dim] = -1  # Keep local length.
        return (src, *sizes), args[1]

    # ---- attention ----------------------------------------------------------------------------

    def _attention(self, node: fx.Node, args: tuple, full: torch.Tensor) -> None:
        call: dict[str, Any] = dict(zip(_SDPA_ARGS, args[0]), **args[1])
        q, k, v, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
        if not all(isinstance(n, fx.Node) and self.shard.get(n) == Shard(2) for n in (q, k, v)):
            raise AutoSPError(_where(node, "attends with q, k and v not all sharded along their "
                                     "sequence dim 2 ([B, H, S, D])"))
        if call.get("dropout_p", 0.0):
            raise AutoSPError(_where(node, "uses attention dropout; AutoSP attention has none"))
        k_source, v_source = self._repeat_source(k), self._repeat_source(v)
        if (k_source is not None and v_source is not None
                and self.full[k_source].shape[1] == self.full[v_source].shape[1]):
            k, v = k_source, v_source  # Move the kv heads, not their copies.
        hq, hkv = self.full[q].shape[1], self.full[k].shape[1]
        causal, scale = bool(call.get("is_causal", False)), call.get("scale")
        group, t, lens = self.owner.group, self.owner.timeout_ms, self.seq_lens
        probes = [self.probe[n] for n in (q, k, v)]
        # The one orchestration (torch.ops.ulysses.attention), given the mask this graph
        # rebuilt once for every layer that shares it.
        rebuilt = self._rebuilt_mask(node, mask, hq, hkv) if mask is not None else None
        out = self.new[node] = self._insert(torch.ops.ulysses.attention, (
            q, k, v, rebuilt, None, hq, hkv, lens, "BHSD", causal, 0.0 if scale is None else float(scale),
            "auto", group, [t], None, None, mask is not None))
        with self.mode:
            probe = full.new_empty((*full.shape[:2], self.probe_len, full.shape[3]))
        self._record(out, full, probe.requires_grad_(any(p.requires_grad for p in probes)), Shard(2))

    def _repeat_source(self, n: fx.Node) -> fx.Node | None:
        """``x`` when ``n`` is ``x``'s kv heads repeated for GQA the way transformers does it
        (``x[:, :, None].expand(B, Hkv, n_rep, S, D).reshape(B, Hkv * n_rep, S, D)``)."""
        expand = n.args[0] if n.op == "call_method" and n.target == "reshape" else None
        if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
            return None
        index = expand.args[0]
        if not (isinstance(index, fx.Node) and index.target is operator.getitem
                and index.args[1] == (slice(None),) * 2 + (None,) + (slice(None),) * 2):
            return None
        src: Any = index.args[0]
        return src if self.shard.get(src) == Shard(2) and self.full[src].dim() == 4 else None

    def _rebuilt_mask(self, node: fx.Node, mask: fx.Node, hq: int, hkv: int) -> fx.Node:
        """The mask rebuilt for this rank's heads over all queries: once per mask (and head
        split, for a per-head mask)."""
        full, s = self.full[mask], self.shard[mask]
        if s is not None and s != Shard(full.dim() - 2):
            which = "key" if s.dim == full.dim() - 1 else f"{s.dim}"
            raise AutoSPError(_where(node, f"gets a mask of shape {list(full.shape)} sharded along "
                                     f"its {which} dim; a mask must be full or sharded along its "
                                     "query dim (-2) only"))
        local = list(full.shape)
        if s is not None:
            local[s.dim] = self.local_len
        try:  # The C++ mask rules decide (and word any error) as they will at run time.
            _C.rebuilt_mask_shape(local, hq, hkv, self.seq_lens, self.owner.rank)
        except ValueError as e:
            raise AutoSPError(_where(node, str(e))) from None
        key = (mask, None if _C.mask_shared_across_heads(list(full.shape)) else (hq, hkv))
        if key not in self.rebuilt_masks:
            self.rebuilt_masks[key] = self._insert(torch.ops.ulysses.rebuild_mask, (
                mask, hq, hkv, self.seq_lens, self.owner.group, [self.owner.timeout_ms]))
        return self.rebuilt_masks[key]

    # ---- losses and token means ---------------------------------------------------------------

    def _loss(self, node: fx.Node, args: tuple, full: torch.Tensor) -> None:
        """cross_entropy / nll_loss over sharded logits: the target is cut to this rank's
        tokens; a token mean becomes the global one (sum and count over the group)."""
        call = dict(_LOSSES[node.target].bind(*args[0], **args[1]).arguments)
        logits, target = call["input"], call["target"]
        s = self.shard[logits]
        if s is None or s.dim == 1 or call.get("reduce") is not None or call.get("size_average") is not None:
            raise AutoSPError(_where(node, "computes a loss AutoSP cannot split by tokens (logits "
                                     "sharded along the class dim, or the deprecated "
                                     "size_average/reduce)"))
        want = Shard(s.dim if s.dim == 0 else s.dim - 1, s.outer, s.inner)
        if self.shard[target] is None:
            call["target"] = self._narrow(target, want)
        elif self.shard[target] != want:
            raise AutoSPError(_where(node, "gets a target sharded unlike its logits"))
        reduction = call.get("reduction", "mean")
        if reduction == "none":
            self._copy(node, ((), call), full)
            return
        if reduction == "mean" and call.get("weight") is not None:
            raise AutoSPError(_where(node, "takes a class-weighted token mean; use "
                                     "reduction='sum' and divide by the global weight"))
        local_sum = self._insert(node.target, (), dict(call, reduction="sum"))
        if reduction == "sum":
            out = self._insert(torch.ops.ulysses.sum_over_group, (local_sum, self.owner.group, [self.owner.timeout_ms]))
        else:
            kept = self._insert(operator.ne, (call["target"], call.get("ignore_index", _C.IGNORE_INDEX)))
            count = self._insert(torch.sum, (kept,), {"dtype": full.dtype})
            stats = self._insert(torch.stack, ([local_sum, count],))
            total = self._insert(torch.ops.ulysses.sum_over_group, (stats, self.owner.group, [self.owner.timeout_ms]))
            out = self._insert(operator.truediv, (self._insert(operator.getitem, (total, 0)),
                                                  self._insert(operator.getitem, (total, 1))))
        self.new[node] = out
        self._record(out, full)

    def _global_sum(self, node: fx.Node, args: tuple, full: torch.Tensor) -> None:
        """``x.sum()`` / ``x.mean()`` over every token: summed over the group (a mean divides by
        the full element count)."""
        src = args[0][0]
        local = self._insert(torch.sum, (src,), args[1])
        out = self._insert(torch.ops.ulysses.sum_over_group, (local, self.owner.group, [self.owner.timeout_ms]))
        if node.target == "mean":
            out = self._insert(operator.truediv, (out, self.full[src].numel()))
        self.new[node] = out
        self._record(out, full)

    # ---- helpers ------------------------------------------------------------------------------

    def _insert(self, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        name = "ulysses_" + getattr(target, "__name__", "op").split(".")[-1]
        new = self.graph.create_node("call_function", target, args, kwargs or {}, name=name)
        new.meta["stack_trace"] = self.trace
        return new

    def _record(self, new: fx.Node, full: Any, probe: Any = None, shard: Shard | None = None):
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


def _meta(node: fx.Node) -> dict:
    # Source locations only: the original's example values hold full-sequence shapes.
    return {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")}


def _graph_break() -> str | None:
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


def _nodes(args) -> list[fx.Node]:
    found: list[fx.Node] = []
    map_arg(args, found.append)
    return found


def _reduces_all(node: fx.Node) -> bool:
    return len(node.args) == 1 and not set(node.kwargs) - {"dtype"}


def _where(node: fx.Node, problem: str) -> str:
    trace = [line.strip() for line in node.meta.get("stack_trace", "").splitlines()
             if line.strip() and set(line.strip()) - set("^~")]
    origin = f" ({trace[-2]}: {trace[-1]})" if len(trace) >= 2 else ""
    return f"node {node.name!r} ({node.format_node()}){origin} {problem}"


__all__ = ["AutoSP", "AutoSPError", "Shard", "autosp", "mark_sequence"]
