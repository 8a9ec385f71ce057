"""Long sequences past attention: sequence-tiled compute and checkpointed layers.

Sequence parallelism divides attention's activations by P. At long S the rest of the model
then sets each rank's peak: the logits ``[S_r, V]`` (in fp32 for the loss), the MLP's
intermediate ``[S_r, I]`` and every layer's saved activations. Each has its tool here:

- :func:`tiled_mlp` runs a position-wise module (an MLP) tile by tile along the sequence: only
  one tile's intermediate exists at a time, and backward recomputes it tile by tile.
- :func:`linear_cross_entropy` is the logits ``hidden @ weight.T`` and their cross-entropy,
  tile by tile, never the whole logits: forward keeps each row's logsumexp, backward recomputes
  one tile's logits at a time for the gradients.
- :func:`checkpoint` runs a layer keeping only its input and recomputes the layer in backward;
  with ``mode="offload"`` that input moves to host memory by a background copy and is restored
  (prefetched one layer ahead) in backward.

All three are exact: each output row and each gradient is computed by the same operations as
untiled, only summed in another order (fp32 rounding).

The tile count is a function of the group's agreed sequence split (:func:`tile_count`), so it is
the same on every rank without a collective: a rank with fewer tokens runs as many, smaller tiles.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from . import _C

IGNORE_INDEX: int = _C.IGNORE_INDEX  # The C++ rule (sharding.h kIgnoreIndex); ulysses.training's.


def tile_count(rows: Sequence[int] | int, tile_rows: int) -> int:
    """Tiles for a sequence split ``rows`` (every rank's row count, or the largest): enough for
    the largest rank's rows at ``tile_rows`` each. Ranks that share ``rows`` agree on it."""
    largest = rows if isinstance(rows, int) else max(rows, default=0)
    return _C.tile_count(largest, tile_rows)  # The C++ rule (tiled.h).


_context = threading.local()


@contextlib.contextmanager
def sequence_rows(rows: int | None) -> Iterator[None]:
    """Declares the largest rank's sequence length for the tiled compute inside (a model's
    forward sets it from the agreed split); :func:`checkpoint` replays it in recompute."""
    previous = getattr(_context, "rows", None)
    _context.rows = rows
    try:
        yield
    finally:
        _context.rows = previous


def current_rows() -> int | None:
    """The sequence length declared by the innermost :func:`sequence_rows`, or None."""
    return getattr(_context, "rows", None)


def _tile_bounds(n: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` contiguous near-equal pieces of ``range(n)`` (some empty when n < tiles): the
    even split of every head, token and tile split (C++ ``even_split``)."""
    return _C.even_split(n, tiles)


# ---- tiled MLP --------------------------------------------------------------------------------


class _TiledMap(torch.autograd.Function):
    """``run`` over row tiles of ``x``: forward keeps x only; backward recomputes one tile at a
    time (in forward order, from the forward's RNG state), writes each tile's input gradient
    into its slice of one buffer, and sums the parameter gradients here, so each parameter's
    gradient leaves this node once."""

    @staticmethod
    def forward(ctx, run, bounds, dim, x, *params):  # type: ignore[override]
        ctx.run, ctx.bounds, ctx.dim, ctx.params = run, bounds, dim, params
        ctx.replay = _replay_state(x.device)
        ctx.save_for_backward(x)
        out = None
        with torch.no_grad():
            for a, b in bounds:
                piece = _one_tensor(run(x.narrow(dim, a, b - a)))
                if out is None:
                    shape = list(piece.shape)
                    shape[dim] = x.shape[dim]
                    out = piece.new_empty(shape)
                out.narrow(dim, a, b - a).copy_(piece)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        needs = ctx.needs_input_grad[4:]
        params = [p for p, need in zip(ctx.params, needs) if need]
        grad_x = torch.empty_like(x) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        with torch.enable_grad(), ctx.replay():
            for a, b in ctx.bounds:
                tile = x.narrow(ctx.dim, a, b - a).detach().requires_grad_(need_x)
                out = ctx.run(tile)
                inputs = ([tile] if need_x else []) + params
                got = torch.autograd.grad(out, inputs, grad_out.narrow(ctx.dim, a, b - a), allow_unused=True)
                if need_x:
                    grad_x.narrow(ctx.dim, a, b - a).copy_(got[0])
                for i, g in enumerate(got[need_x:]):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
        grads = iter(sums)
        return (None, None, None, grad_x, *(next(grads) if need else None for need in needs))


def tiled_mlp(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int, dim: int = -2, *,
              params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """``module(x)`` for a position-wise ``module`` (each output row depends on its input row
    only, as an MLP's does), computed in ``tiles`` pieces along ``dim``. The forward keeps no
    intermediate; backward recomputes one piece at a time, writes each piece's input gradient
    into its slice of one buffer and sums the gradients of ``params`` (default: the parameters
    of the module ``module`` runs), which reach each parameter once."""
    if tiles < 1:
        raise ValueError(f"tiled_mlp: tiles must be >= 1; got {tiles}")
    dim %= x.dim()
    bounds = [(a, b) for a, b in _tile_bounds(x.shape[dim], tiles) if b > a]
    if len(bounds) <= 1:
        return _one_tensor(module(x))
    if not torch.is_grad_enabled():
        return torch.cat([_one_tensor(module(x.narrow(dim, a, b - a))) for a, b in bounds], dim)
    if params is None:
        owner = _module_of(module)
        if owner is None:
            raise ValueError("tiled_mlp: pass params= (the tensors that need the function's gradients) for a "
                             "function that is not a module, its bound forward or a partial over either")
        params = [p for p in owner.parameters() if p.requires_grad]
    return _TiledMap.apply(module, bounds, dim, x, *params)


def _one_tensor(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"tiled_mlp: the module returned a {type(out).__name__}; only a module that returns "
                        "one tensor (position-wise, such as an MLP) can be tiled")
    return out


# ---- tiled logits + cross-entropy -------------------------------------------------------------


def label_problem(hidden: torch.Tensor, vocab: int, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> str:
    """What is wrong with ``labels`` for :func:`linear_cross_entropy` over ``hidden`` and a
    ``vocab``-row weight, or "" (callers that must fail together check this first)."""
    if hidden.shape[:-1] != labels.shape:
        return (f"linear_cross_entropy: hidden {list(hidden.shape)} and labels {list(labels.shape)} must agree on "
                "every dim but the last")
    return _C.target_problem(labels, vocab, ignore_index, "linear_cross_entropy", "labels")  # The C++ rule.


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None, tiles: int = 1, ignore_index: int = IGNORE_INDEX,
                         scale: float = 1.0, softcap: float = 0.0) -> torch.Tensor:
    """The summed cross-entropy of the logits ``hidden @ weight.T (+ bias)`` against
    ``labels`` (rows labelled ``ignore_index`` excluded), in ``tiles`` tiles of rows: the
    logits of one tile at a time, in fp32 as a loss computes them. ``hidden [..., E]``,
    ``labels [...]``. ``scale`` multiplies the logits and ``softcap`` caps them
    (``c * tanh(z / c)``, Gemma's final softcap), in that order. Returns a 0-d fp32 sum: divide
    by the token count of the whole batch for the mean."""
    problem = label_problem(hidden, weight.shape[0], labels, ignore_index)
    if problem:
        raise ValueError(problem)
    return _checked_linear_cross_entropy(hidden, weight, labels, bias=bias, tiles=tiles, ignore_index=ignore_index,
                                         scale=scale, softcap=softcap)


def _checked_linear_cross_entropy(hidden, weight, labels, *, bias, tiles, ignore_index, scale, softcap):
    """:func:`linear_cross_entropy` for labels a caller has already passed through
    :func:`label_problem` (ulysses.hf does, together with the other ranks): the C++ op
    (tiled.h's linear_cross_entropy_sum, with its own backward)."""
    if tiles < 1:
        raise ValueError(f"linear_cross_entropy: tiles must be >= 1; got {tiles}")
    return torch.ops.ulysses.linear_cross_entropy_sum(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                      labels.reshape(-1), tiles, ignore_index, bias,
                                                      float(scale), float(softcap))


# ---- checkpointed layers with host offload ----------------------------------------------------

_copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ulysses-offload")


def live_host_bytes() -> int:
    """Bytes of host buffers that offloaded checkpoints hold now (0 once every graph that made
    them is gone, whether its backward finished, failed or never ran): the one count, C++'s
    (src/training/offloaded_bytes.h), of Python's checkpoints and the C++ ones alike."""
    return _C.offloaded_bytes()


class _HostCopy:
    """One tensor moved to host memory by a background copy and restored on demand. On CUDA
    the copy runs on a side stream into pinned memory; on a CPU tensor in a worker thread (the
    copy releases the GIL), which exercises the same path but saves nothing: host memory is the
    device's."""

    def __init__(self, x: torch.Tensor, stream: Any) -> None:
        self.device, self.stream = x.device, stream
        self.host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
        nbytes = self.host.numel() * self.host.element_size()
        _C.count_offloaded_bytes(nbytes)
        weakref.finalize(self.host, _C.count_offloaded_bytes, -nbytes)
        self.done: Any
        self.restored: Future | None = None
        if x.is_cuda:
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                self.host.copy_(x, non_blocking=True)
                x.record_stream(stream)  # x's memory is not reused before the copy reads it
                self.done = stream.record_event()
        else:
            self.done = _copier.submit(self.host.copy_, x)

    def prefetch(self) -> None:
        """Starts the copy back to the device (no copy for a CPU tensor)."""
        if self.restored is not None or not self.device.type == "cuda":
            return
        future: Future = Future()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.done)
            future.set_result(self.host.to(self.device, non_blocking=True))
        self.restored = future

    def restore(self) -> torch.Tensor:
        if self.device.type != "cuda":
            self.done.result()
            return self.host
        self.prefetch()
        assert self.restored is not None
        x = self.restored.result()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        x.record_stream(torch.cuda.current_stream(self.device))
        return x


class _Offloads:
    """The offloaded inputs of one forward, in order: restoring one prefetches the one before
    it (backward runs the layers in reverse). Weakly held: a graph that is dropped frees them."""

    def __init__(self) -> None:
        self.copies: list[weakref.ref] = []
        self.stream: Any = None

    def put(self, x: torch.Tensor) -> tuple[_HostCopy, int]:
        if x.is_cuda and self.stream is None:
            self.stream = torch.cuda.Stream(x.device)
        copy = _HostCopy(x, self.stream)
        self.copies.append(weakref.ref(copy))
        return copy, len(self.copies) - 1

    def prefetch_before(self, index: int) -> None:
        if index > 0 and (earlier := self.copies[index - 1]()) is not None:
            earlier.prefetch()


_forward_offloads: threading.local = threading.local()


@contextlib.contextmanager
def offload_scope() -> Iterator[None]:
    """Groups the offloaded checkpoints of one forward, for prefetching (optional: without it
    each checkpoint restores its own input when backward reaches it)."""
    previous = getattr(_forward_offloads, "value", None)
    _forward_offloads.value = _Offloads()
    try:
        yield
    finally:
        _forward_offloads.value = previous


def _replay_state(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """What a recompute must see as the forward saw it: the RNG (dropout draws the same),
    autocast and the declared sequence rows (tiles cut alike)."""
    devices = [device] if device.type == "cuda" else []
    rows = current_rows()
    cpu_rng = torch.get_rng_state()
    cuda_rng = [torch.cuda.get_rng_state(device)] if devices else []
    autocast = [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                for kind in {"cpu", device.type}]

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(sequence_rows(rows))
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(cpu_rng)
            for d, state in zip(devices, cuda_rng):
                torch.cuda.set_rng_state(state, d)
            for kind, enabled, dtype in autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            yield

    return replay


#: How a checkpointed layer keeps its input: the C++ Checkpoint's names (tiled.h), "none" first.
CHECKPOINT_MODES: tuple[str, ...] = tuple(_C.checkpoint_modes())


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, offload, x, *params):  # type: ignore[override]
        ctx.run, ctx.replay, ctx.params = run, _replay_state(x.device), params
        if offload:
            scope = getattr(_forward_offloads, "value", None) or _Offloads()
            ctx.offloads = scope
            ctx.copy, ctx.index = scope.put(x)
        else:
            ctx.copy = None
            ctx.save_for_backward(x)
        with torch.no_grad():
            out = run(x)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if ctx.copy is not None:
            x = ctx.copy.restore()
            ctx.offloads.prefetch_before(ctx.index)
            ctx.copy = None
        else:
            (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        x = x.detach().requires_grad_(need_x)
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        with torch.enable_grad(), ctx.replay():
            out = ctx.run(x)
        outs = out if ctx.tuple_out else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        inputs = ([x] if need_x else []) + params
        got = iter(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
                   if pairs else [None] * len(inputs))
        grad_x = next(got) if need_x else None
        grad_params = [next(got) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, grad_x, *grad_params)


def _module_of(function: Callable) -> torch.nn.Module | None:
    """The module a layer function runs: a module, its bound forward, or a partial over either
    (transformers checkpoints ``partial(forward, layer, **kwargs)``)."""
    while isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], torch.nn.Module):
            return function.args[0]
        function = function.func
    if isinstance(function, torch.nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _check_no_hidden_inputs(function: Callable, args: tuple, kwargs: dict) -> None:
    """A tensor that needs a gradient and reaches the layer other than as its first input (in
    ``args``, by keyword, or bound in a partial) would get none: refuse."""
    named = [(f"positional argument {i + 2}", v) for i, v in enumerate(args)]
    named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    while isinstance(function, functools.partial):
        named += [(f"keyword argument {k!r}", v) for k, v in function.keywords.items()]
        function = function.func
    for name, value in named:
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            raise ValueError(f"ulysses.tiled.checkpoint: the layer's {name} needs a gradient, which a "
                             "checkpoint gives to its first input and the layer's parameters only")


def checkpoint(function: Callable[..., Any], x: torch.Tensor, *args: Any, mode: str = "recompute",
               params: Sequence[torch.Tensor] | None = None, **kwargs: Any) -> Any:
    """``function(x, *args, **kwargs)`` keeping only ``x``: backward recomputes the layer
    (with the forward's RNG and autocast state) and returns the gradients of ``x`` and of
    ``params`` (default: the parameters of the module ``function`` runs). ``mode`` (one of
    :data:`CHECKPOINT_MODES`): ``"recompute"``; ``"offload"``, where ``x`` moves to host memory
    by a background copy and comes back in backward, prefetched one layer ahead inside an
    :func:`offload_scope`; ``"none"``, the layer as it is.

    The gradients reach the parameters through this node, once each (so DDP's hooks see one
    gradient per parameter, as without checkpointing). Tensors in ``args``/``kwargs`` get no
    gradient; one that needs it is refused."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"ulysses.tiled.checkpoint: mode must be one of {', '.join(CHECKPOINT_MODES)}; got {mode!r}")
    _check_no_hidden_inputs(function, args, kwargs)
    # x first, then the rest (as transformers' layers call it: a vision encoder's passes its mask
    # positionally after the hidden states).
    run = (lambda y: function(y, *args, **kwargs)) if args or kwargs else function
    if mode == "none" or not torch.is_grad_enabled():
        return run(x)
    if params is None:
        module = _module_of(function)
        params = [] if module is None else [p for p in module.parameters() if p.requires_grad]
    return _Checkpoint.apply(run, mode == "offload", x, *params)


__all__ = ["CHECKPOINT_MODES", "checkpoint", "current_rows", "label_problem", "linear_cross_entropy", "live_host_bytes",
           "offload_scope", "sequence_rows", "tile_count", "tiled_mlp"]
