"""Hybrid models' token mixers under sequence parallelism: transformers' gated delta-nets
(Qwen3-Next, Qwen3.5), Mamba-2 layers (Bamba, Nemotron-H, Granite 4) and short convolutions
(LFM2), exact, each with the model's own kernels.

A gated delta-net is independent across its value heads, as attention is across its query
heads, and its key heads serve groups of value heads as kv heads serve query heads. So it runs
through the same exchange and partition as attention (Note [Head partition], partition.h); a
Mamba-2 layer likewise, its heads as the value heads and its B/C groups as the key heads
(``mamba2_forward``):

- the projections run on this rank's tokens; the value heads' inputs (v, b, a) go out as the
  "q" tensor and the key heads' (q, k) as the "kv" tensor, in one ``scatter_heads``: key heads
  fewer than the ranks are replicated, and the exchange's backward sums their gradients;
- on the whole sequence of this rank's heads: the depthwise causal convolution with the weight
  rows of those heads' channels, the gates with those heads' ``A_log`` and ``dt_bias`` (slices
  taken in forward, so gradients reach the full parameters) and the model's chunked delta rule;
- the output comes back in one ``gather_heads``; the gated norm (per token and head, with z,
  which never travels) and the output projection run on this rank's tokens.

A short convolution (LFM2's, kernel K) mixes each channel over its last K tokens only, so it
needs just the K - 1 tokens before this rank's shard: one all-gather of every rank's last K - 1
(its backward sums their gradients back), then the model's convolution on those tokens and the
shard.

The layer's own forward runs where no sequence-parallel forward is under way (``ulysses.hf``'s
``unsharded``, ``verify``'s reference), from the layer kwargs the sequence-parallel forward
passes (``ulysses_seq_lens``).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import groups as G
from . import ops as O
from .plans import head_plan


@dataclass(frozen=True)
class _Shard:
    """What a mixer's sharded forward runs with: the agreed split, the group, and the mixer's
    modeling module, whose kernels it calls (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``,
    ``mamba2_chunk_scan``, ``apply_mask_to_padding_states``; the hub's fast kernels replace them
    where installed)."""

    seq_lens: list[int]
    group: str
    timeout: G.Wait
    code: types.ModuleType


def _sharded(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A mixer's forward under SP from ``forward(mixer, hidden_states, attention_mask, shard)``:
    the layer's own forward where no sequence-parallel forward is under way (no
    ``ulysses_seq_lens``), and a cache refused (every rank passes the same ``use_cache``)."""

    @functools.wraps(forward)
    def run(mixer: Any, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
            **kwargs) -> torch.Tensor:
        seq_lens = kwargs.get("ulysses_seq_lens")
        if not seq_lens:
            return type(mixer).forward(mixer, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if cache is not None:
            raise ValueError(f"ulysses.hf: {type(mixer).__name__} got a cache under sequence parallelism (a cache "
                             "of one shard's states would be wrong); train with use_cache=False, and generate "
                             "inside ulysses.hf.unsharded(model)")
        shard = _Shard(list(seq_lens), mixer.__dict__["_ulysses_group"], mixer.__dict__.get("_ulysses_timeout"),
                       sys.modules[type(mixer).__module__])
        return forward(mixer, hidden_states, attention_mask, shard)

    return run


@dataclass(frozen=True)
class _Heads:
    """This rank's heads after the exchange: its "q" and "kv" head ranges and kv map (the head
    plan's)."""

    q: tuple[int, int]
    kv: tuple[int, int]
    kv_map: list[int]

    def one_kv_per_q(self, *kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``kv`` tensors ``[B, S, kv heads, ..]`` as the kernels take them: as they are where each kv
        head serves an even run of consecutive q heads (the kernels repeat them), else one copy
        per q head (an uneven split)."""
        q_heads, kv_heads = self.q[1] - self.q[0], self.kv[1] - self.kv[0]
        if q_heads % kv_heads == 0 and self.kv_map == [i // (q_heads // kv_heads) for i in range(q_heads)]:
            return kv
        index = torch.tensor(self.kv_map, device=kv[0].device)
        return tuple(t.index_select(2, index) for t in kv)


def _to_heads(values: torch.Tensor, keys: torch.Tensor, shard: _Shard) -> tuple[torch.Tensor, torch.Tensor, _Heads]:
    """``values [B, S_r, H, .]`` ("q" heads) and ``keys [B, S_r, Hkv, .]`` ("kv" heads) to this
    rank's heads over the whole sequence, in one exchange."""
    heads, kv_heads = values.shape[2], keys.shape[2]
    values, keys = O.scatter_heads([values, keys], ["q", "kv"], heads, kv_heads, shard.seq_lens, "BSHD",
                                   shard.group, shard.timeout)
    rank, size = G.rank_and_size(shard.group)
    plan = head_plan(heads, kv_heads, size)
    return values, keys, _Heads(plan["q_ranges"][rank], plan["kv_ranges"][rank], list(plan["kv_map"][rank]))


def _from_heads(y: torch.Tensor, heads: int, kv_heads: int, shard: _Shard) -> torch.Tensor:
    """This rank's heads ``[B, S, H_r, D]`` back to its tokens ``[B, S_r, H, D]``, in one exchange."""
    return O.gather_heads([y], ["q"], heads, kv_heads, shard.seq_lens, "BSHD", shard.group, shard.timeout)[0]


def _convolve(mixer: Any, shard: _Shard, parts: list[torch.Tensor], channels: list[tuple[int, int]],
              activation: str | None) -> list[torch.Tensor]:
    """The layer's depthwise causal convolution over the whole sequence of ``parts`` (``[B, S, ..]``,
    flattened and concatenated), with the weight rows of its ``channels`` (ranges, in order):
    the parts, convolved, in their shapes."""
    index = torch.cat([torch.arange(begin, end) for begin, end in channels]).to(parts[0].device)
    weight = mixer.conv1d.weight.squeeze(1).index_select(0, index)
    bias = None if mixer.conv1d.bias is None else mixer.conv1d.bias.index_select(0, index)
    mixed = torch.cat([t.flatten(2) for t in parts], -1).transpose(1, 2)
    mixed = shard.code.causal_conv1d_fn(mixed, weight, bias, activation=activation).transpose(1, 2)
    return [t.reshape(p.shape) for t, p in zip(mixed.split([p[0, 0].numel() for p in parts], -1), parts)]


# ---- gated delta-nets --------------------------------------------------------------------------


def _delta_net_inputs(mixer: Any, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The projections of ``h [B, S_r, E]`` as the layer's forward makes them: q, k
    ``[B, S_r, Hk, Dk]``, v, z ``[B, S_r, Hv, Dv]``, b, a ``[B, S_r, Hv]``."""
    B, s = h.shape[:2]
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next: interleaved by key head
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(h), mixer.in_proj_ba(h))
        return q, k, v, z, b, a
    # Qwen3.5: [q | k | v] head-major, then z, b and a of their own
    q, k, v = mixer.in_proj_qkv(h).split([mixer.key_dim, mixer.key_dim, mixer.value_dim], -1)
    q, k = (t.reshape(B, s, -1, mixer.head_k_dim) for t in (q, k))
    v = v.reshape(B, s, -1, mixer.head_v_dim)
    z = mixer.in_proj_z(h).reshape(B, s, -1, mixer.head_v_dim)
    return q, k, v, z, mixer.in_proj_b(h), mixer.in_proj_a(h)


@_sharded
def gated_delta_net_forward(mixer: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                            shard: _Shard) -> torch.Tensor:
    """A gated delta-net layer (Qwen3-Next's, Qwen3.5's) on this rank's shard ``[B, S_r, E]``
    (module docstring)."""
    h = shard.code.apply_mask_to_padding_states(hidden_states, attention_mask)
    q, k, v, z, b, a = _delta_net_inputs(mixer, h)
    hk, hv, dk, dv = q.shape[2], v.shape[2], mixer.head_k_dim, mixer.head_v_dim
    # Value heads as "q" (v, b, a), key heads as "kv" (q, k).
    values = torch.cat([v, b[..., None].to(v.dtype), a[..., None].to(v.dtype)], -1)
    values, keys, mine = _to_heads(values, torch.cat([q, k], -1), shard)
    (kb, ke), (vb, ve) = mine.kv, mine.q
    q, k = keys.split(dk, -1)
    v, b, a = values.split([dv, 1, 1], -1)
    key_dim = mixer.key_dim
    q, k, v = _convolve(mixer, shard, [q, k, v], [(kb * dk, ke * dk), (key_dim + kb * dk, key_dim + ke * dk),
                                                  (2 * key_dim + vb * dv, 2 * key_dim + ve * dv)], mixer.activation)
    beta = b.squeeze(-1).sigmoid()
    g = -mixer.A_log[vb:ve].float().exp() * F.softplus(a.squeeze(-1).float() + mixer.dt_bias[vb:ve])
    q, k = mine.one_kv_per_q(q, k)
    o, _ = shard.code.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
                                                    output_final_state=False, use_qk_l2norm_in_kernel=True)
    o = _from_heads(o, hv, hk, shard)
    o = mixer.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(z.shape)
    return mixer.out_proj(o.flatten(2))


# ---- Mamba-2 ------------------------------------------------------------------------------------


@_sharded
def mamba2_forward(mixer: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                   shard: _Shard) -> torch.Tensor:
    """A Mamba-2 layer (Bamba's, Nemotron-H's, Granite 4's copies of transformers' ``Mamba2Mixer``)
    on this rank's shard ``[B, S_r, E]``: as the gated delta-net, with heads as "q" (x, dt, and
    the padding mask the layer applies after its convolution, one channel per head) and the B/C
    groups as "kv"; the gated norm, grouped over heads, runs on this rank's tokens after the
    exchange back."""
    heads, groups, state, head_dim = mixer.num_heads, mixer.n_groups, mixer.ssm_state_size, mixer.head_dim
    inner = mixer.intermediate_size
    h = shard.code.apply_mask_to_padding_states(hidden_states, attention_mask)
    gate, xbc, dt = mixer.in_proj(h).split([inner, mixer.conv_dim, heads], dim=-1)
    B, s = h.shape[:2]
    x, bs, cs = xbc.split([inner, groups * state, groups * state], -1)
    keep = torch.ones(B, s, dtype=xbc.dtype, device=xbc.device) if attention_mask is None else attention_mask
    keep = keep.to(xbc.dtype)[:, :, None, None].expand(-1, -1, heads, 1)
    values = torch.cat([x.reshape(B, s, heads, head_dim), dt[..., None], keep], -1)
    keys = torch.cat([bs.reshape(B, s, groups, state), cs.reshape(B, s, groups, state)], -1)
    values, keys, mine = _to_heads(values, keys, shard)
    (hb, he), (gb, ge) = mine.q, mine.kv
    x, dt, keep = values.split([head_dim, 1, 1], -1)
    bs, cs = keys.split(state, -1)
    x, bs, cs = _convolve(mixer, shard, [x, bs, cs], [(hb * head_dim, he * head_dim),
                                                      (inner + gb * state, inner + ge * state),
                                                      (inner + (groups + gb) * state, inner + (groups + ge) * state)],
                          mixer.activation)
    x, bs, cs = ((t * keep[..., :1, :]).to(t.dtype) for t in (x, bs, cs))  # the layer's mask after its convolution
    bs, cs = mine.one_kv_per_q(bs, cs)
    y = shard.code.mamba2_chunk_scan(x, dt.squeeze(-1), -torch.exp(mixer.A_log[hb:he].float()), bs, cs,
                                     chunk_size=mixer.chunk_size, D=mixer.D[hb:he], dt_bias=mixer.dt_bias[hb:he],
                                     dt_softplus=True, dt_limit=mixer.time_step_limit)
    y = mixer.norm(_from_heads(y, heads, groups, shard).reshape(B, s, -1), gate)
    return mixer.out_proj(y.to(hidden_states.dtype))


# ---- short convolutions --------------------------------------------------------------------------


def _with_tokens_before(x: torch.Tensor, count: int, seq_lens: list[int], group: str,
                        timeout: G.Wait) -> torch.Tensor:
    """``x [.., S_r]`` (sequence last) with the ``count`` tokens before this rank's shard put in
    front (zeros before the sequence's start): one all-gather of every rank's last ``count``
    tokens, whose backward returns each rank its tokens' gradients."""
    rank = G.rank_and_size(group)[0]
    tails = [min(count, n) for n in seq_lens]
    mine = x.narrow(-1, x.shape[-1] - tails[rank], tails[rank])
    gathered = O.all_gather_sequence(mine, x.dim() - 1, tails, group, timeout)
    before = gathered.narrow(-1, 0, sum(tails[:rank]))
    before = before.narrow(-1, max(0, before.shape[-1] - count), min(count, before.shape[-1]))
    return torch.cat([F.pad(before, (count - before.shape[-1], 0)), x], -1)


@_sharded
def short_conv_forward(mixer: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                       shard: _Shard) -> torch.Tensor:
    """A short-convolution layer (LFM2's) on this rank's shard ``[B, S_r, E]`` (module docstring)."""
    h = shard.code.apply_mask_to_padding_states(hidden_states, attention_mask)
    gate_in, gate_out, x = mixer.in_proj(h).transpose(-1, -2).chunk(3, dim=-2)
    before = mixer.conv_kernel_size - 1
    bx = _with_tokens_before(gate_in * x, before, shard.seq_lens, shard.group, shard.timeout)
    conv = shard.code.causal_conv1d_fn(bx, mixer.conv.weight.squeeze(1), mixer.conv.bias)[..., before:]
    return mixer.out_proj((gate_out * conv).transpose(-1, -2).contiguous())


# ---- which mixers -------------------------------------------------------------------------------

#: The token mixers run exactly under sequence parallelism, by class name: their forward and
#: the config layer type they serve.
MIXERS: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "Qwen3NextGatedDeltaNet": (gated_delta_net_forward, "linear_attention"),
    "Qwen3_5GatedDeltaNet": (gated_delta_net_forward, "linear_attention"),
    "Qwen3_5MoeGatedDeltaNet": (gated_delta_net_forward, "linear_attention"),
    "BambaMixer": (mamba2_forward, "linear_attention"),
    "NemotronHMamba2Mixer": (mamba2_forward, "linear_attention"),
    "GraniteMoeHybridMambaLayer": (mamba2_forward, "linear_attention"),
    "Lfm2ShortConv": (short_conv_forward, "conv"),
    "Lfm2MoeShortConv": (short_conv_forward, "conv"),
}


def layer_types_served(model_class: type) -> set[str]:
    """The config layer types the mixers of ``model_class``'s modeling module serve."""
    code = sys.modules.get(model_class.__module__)
    names = vars(code) if code is not None else {}
    return {layer_type for name, (_, layer_type) in MIXERS.items() if name in names}


def install(model: torch.nn.Module) -> list[str]:
    """Binds the sequence-parallel forward to every known mixer of ``model``; returns their
    class names (a deep copy rebinds, as transformers' own bound methods do)."""
    found = []
    for module in model.modules():
        entry = MIXERS.get(type(module).__name__)
        if entry is not None:
            module.forward = types.MethodType(entry[0], module)
            found.append(type(module).__name__)
    return sorted(set(found))


def refuse_documents(model_class: type, positions: torch.Tensor | None, attention_mask: torch.Tensor | None,
                     seq_lens: list[int], group: str, timeout: G.Timeout | G.Wait = None) -> None:
    """Raises on every rank alike when a row's position ids restart (packed documents): the
    mixers' own code (its torch path) runs across documents, so such rows are refused. One
    small collective: each rank's range of position minus global index per row, padding
    excluded."""
    if positions is None:
        return
    rank, size = G.rank_and_size(group)
    start = sum(seq_lens[:rank])
    offsets = positions.reshape(-1, positions.shape[-1]).long() - torch.arange(start, start + positions.shape[-1],
                                                                                device=positions.device)
    big = torch.iinfo(torch.int64).max // 2
    real = torch.ones_like(offsets, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    offsets, real = torch.broadcast_tensors(offsets, real)
    edge = offsets.new_full((offsets.shape[0], 1), big)  # (an empty shard's rows stay neutral)
    low = torch.cat([offsets.masked_fill(~real, big), edge], -1).amin(-1)
    high = torch.cat([offsets.masked_fill(~real, -big), -edge], -1).amax(-1)
    ranges = O.all_gather_sequence(torch.stack([low, high])[None], 0, [1] * size, group, timeout)
    low, high = ranges[:, 0].amin(0), ranges[:, 1].amax(0)
    if bool(((low != high) & (low != big)).any()):
        raise ValueError(f"ulysses.hf: {model_class.__name__} got packed rows (position ids restarting within a "
                         "row), and the model's own token mixers outside attention (their torch path) run across "
                         "documents; under sequence parallelism they are refused: give one document per row "
                         "(padded), or train it without sequence parallelism")
