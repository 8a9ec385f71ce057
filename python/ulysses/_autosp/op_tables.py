"""The ops the AutoSP rewrite knows by name: attention, losses, shape queries, reshapes, ops that
mix values along a dim, convolutions, and which ops are pointwise."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA = torch._C._nn.scaled_dot_product_attention
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
LOSSES: dict[Any, inspect.Signature] = {F.cross_entropy: inspect.signature(F.cross_entropy),
           F.nll_loss: inspect.signature(F.nll_loss)}
# Shape-only queries of a sharded tensor answer for the full sequence, as the model expects.
SHAPE_QUERIES = {"size", "numel"}
SYM_QUERIES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default}
RESHAPES = {"view", "reshape"}
# Ops that mix values along a dim while keeping its size: name -> (position of that dim
# argument, default). On the sharded dim they would see this rank's tokens only.
ALONG_DIM = {"roll": (2, None), "flip": (1, None), "cumsum": (1, None), "cumprod": (1, None),
              "cummax": (1, None), "cummin": (1, None), "logcumsumexp": (1, None),
              "softmax": (1, None), "log_softmax": (1, None), "sort": (1, -1), "argsort": (1, -1),
              "topk": (2, -1), "diff": (2, -1)}
CONVOLUTIONS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                 F.conv_transpose3d}
OPERATOR_ATEN = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "floordiv": "floor_divide",
                  "mod": "remainder", "pow": "pow", "and_": "bitwise_and", "or_": "bitwise_or",
                  "xor": "bitwise_xor", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt",
                  "ge": "ge", "neg": "neg", "invert": "bitwise_not", "iadd": "add", "imul": "mul"}


def is_pointwise(node: fx.Node) -> bool:
    """Broadcasting elementwise ops (by aten's pointwise tag), plus cat/stack (aligned dims)."""
    name: Any
    if node.op == "call_method":
        name = node.target
    elif node.target in (torch.cat, torch.stack, torch.concat):
        return True
    elif getattr(node.target, "__module__", None) == "_operator":
        name = OPERATOR_ATEN.get(getattr(node.target, "__name__", ""))
    else:
        name = getattr(node.target, "__name__", None)
    packet = getattr(torch.ops.aten, name.rstrip("_") if name else "", None) if name else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
