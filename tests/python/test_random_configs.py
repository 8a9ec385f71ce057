"""Seeded random configurations of DistributedAttention vs the single-rank reference, forward and
backward: P 1-4, every layout, even/uneven/GQA/MQA heads, uneven S (empty shards included),
every mask kind (bool or learnable float; shared or per head; sharded, full or broadcast rows;
2-, 3- and 4-D), packed documents, causal (with or without a sliding window), logit softcaps, fp32 and fp64
(the math kernel: exact). One group per P serves all of its configurations."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import ulysses
from conftest import run_ranks, seq_lens, shard
from reference import reference_attention

CONFIGS_PER_P = 60  # x 4 sizes of P = 240 configurations.
LAYOUT_FROM_BSHD = {"BSHD": (0, 1, 2, 3), "SBHD": (1, 0, 2, 3), "BHSD": (0, 2, 1, 3)}
# Mask kinds: (dims, heads "shared"/"per_head", rows "sharded"/"full"/"broadcast").
MASK_KINDS = [None, (4, "shared", "sharded"), (4, "per_head", "sharded"), (4, "per_head", "full"),
              (4, "shared", "broadcast"), (4, "shared", "full"), (2, "shared", "sharded"),
              (3, "per_head", "sharded")]


@dataclass
class Config:
    P: int
    B: int
    S: int
    hq: int
    hkv: int
    D: int
    layout: str
    mask: tuple | None
    float_mask: bool
    packed: bool
    causal: bool
    give_heads: bool
    seed: int
    fp64: bool = False
    window: int = 0  # A sliding window (causal only); 0: none.
    softcap: float = 0.0  # A logit softcap; 0: none.


def random_configs(P: int, n: int, rng: random.Random) -> list[Config]:
    out = []
    for _ in range(n):
        hkv = rng.choice([1, 1, 2, 3, 4])
        hq = hkv * rng.choice([1, 2, 3])
        while hq < P:  # at least one query head per rank
            hq += hkv
        out.append(Config(P=P, B=rng.choice([1, 2]), S=rng.randint(max(1, P - 1), 19), hq=hq, hkv=hkv,
                          D=rng.choice([4, 8]), layout=rng.choice(list(LAYOUT_FROM_BSHD)),
                          mask=rng.choice(MASK_KINDS), float_mask=rng.random() < 0.5,
                          packed=rng.random() < 0.3, causal=rng.random() < 0.4,
                          give_heads=rng.random() < 0.5, seed=rng.randrange(1 << 30),
                          fp64=rng.random() < 0.2))
        c = out[-1]
        if c.causal and rng.random() < 0.4:
            c.window = rng.randint(1, c.S)
        if rng.random() < 0.25:
            c.softcap = rng.choice([0.3, 1.0, 5.0])
    return out


def make_mask(c: Config, gen: torch.Generator) -> torch.Tensor | None:
    if c.mask is None:
        return None
    dims, heads, rows = c.mask
    shape = [c.B if dims == 4 else 1, c.hq if heads == "per_head" else 1, 1 if rows == "broadcast" else c.S,
             c.S]
    m = torch.randn(*shape, generator=gen) if c.float_mask else torch.rand(*shape, generator=gen) > 0.25
    return m.reshape(shape[4 - dims:])


def make_positions(c: Config, gen: torch.Generator) -> torch.Tensor | None:
    if not c.packed:
        return None
    starts = torch.rand(c.B, c.S, generator=gen) < 0.25
    starts[:, 0] = True
    idx = torch.arange(c.S).expand(c.B, c.S)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(1).values
    return idx - last_start  # positions restart at 0 where a document starts


def rel(a, b):
    """Largest error relative to the reference's largest value, or absolute below 1 (a gradient
    that is exactly 0 in float64, e.g. one visible key, is ~1e-8 in fp32)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def reference(c: Config):
    gen = torch.Generator().manual_seed(c.seed)
    Q, K, V = (torch.randn(c.B, c.S, h, c.D, generator=gen) for h in (c.hq, c.hkv, c.hkv))
    M, pos = make_mask(c, gen), make_positions(c, gen)
    learn = M is not None and M.is_floating_point()
    q, k, v = (t.double().requires_grad_() for t in (Q, K, V))
    m = M.double().requires_grad_() if learn else M
    ref = reference_attention(q, k, v, m, pos, c.causal, window=c.window, softcap=c.softcap)
    dO = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * dO).sum().backward()
    grads = [q.grad, k.grad, v.grad, m.grad if learn else None]
    dtype = torch.float64 if c.fp64 else torch.float32
    Q, K, V = (t.to(dtype) for t in (Q, K, V))
    M = M.to(dtype) if learn else M
    return (Q, K, V, M, pos, dO.to(dtype)), ref.detach(), grads


def run_config(c: Config, inputs, rank: int, group: str):
    Q, K, V, M, pos, dO = inputs
    lens = seq_lens(c.S, c.P)
    to_layout = LAYOUT_FROM_BSHD[c.layout]
    seq_dim = to_layout.index(1)
    attn = ulysses.DistributedAttention(group, layout=c.layout, causal=c.causal, window=c.window or None,
                                        softcap=c.softcap or None,
                                        q_heads=c.hq if c.give_heads else None,
                                        kv_heads=c.hkv if c.give_heads else None)
    q, k, v = (shard(t.permute(to_layout), seq_dim, rank, lens).clone().requires_grad_() for t in (Q, K, V))
    m = None
    if M is not None:
        rows = c.mask[2]
        m = shard(M, M.dim() - 2, rank, lens).clone() if rows == "sharded" else M.clone()
        m.requires_grad_(m.is_floating_point())
    p = shard(pos, 1, rank, lens) if pos is not None else None
    o = attn(q, k, v, mask=m, position_ids=p)
    (o * shard(dO.permute(to_layout), seq_dim, rank, lens)).sum().backward()
    to_bshd = [to_layout.index(i) for i in range(4)]
    back = lambda t: t.permute(to_bshd)  # noqa: E731
    return [back(o.detach()), back(q.grad), back(k.grad), back(v.grad),
            m.grad if m is not None and m.requires_grad else None]


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_random_configurations_match_the_single_rank_reference(P):
    configs = random_configs(P, CONFIGS_PER_P, random.Random(1234 + P))
    prepared = [reference(c) for c in configs]

    def body(rank, group):
        return [run_config(c, inputs, rank, group) for c, (inputs, _, _) in zip(configs, prepared)]

    per_rank = run_ranks(P, body, timeout_s=60)
    for i, (c, (_, ref, grads)) in enumerate(zip(configs, prepared)):
        got = [r[i] for r in per_rank]
        tol = 1e-10 if c.fp64 else 1e-5  # fp64 runs the math kernel in fp64
        assert rel(torch.cat([g[0] for g in got], 1), ref) < tol, (i, c)
        for j in range(3):
            assert rel(torch.cat([g[j + 1] for g in got], 1), grads[j]) < 10 * tol, (i, c, "grad", j)
        if grads[3] is not None:
            if c.mask[2] == "sharded":
                dm = torch.cat([g[4] for g in got], grads[3].dim() - 2)
            else:  # an input of every rank: its gradient is the sum over ranks
                dm = sum(g[4] for g in got)
            assert rel(dm, grads[3]) < 10 * tol, (i, c, "mask grad")
