"""The Python module and the C++ API are one orchestration: the same random configurations run
through ``ulysses.DistributedAttention`` and through the C++ ``ulysses::DistributedAttention``
(``_C.cpp_distributed_attention``) give bit-identical outputs and gradients."""

from __future__ import annotations

import random

import pytest
import torch

import ulysses
from conftest import run_ranks, seq_lens, shard
from test_random_configs import LAYOUT_FROM_BSHD, random_configs, reference

CONFIGS_PER_P = 12


def run_both(c, inputs, rank: int, group: str):
    Q, K, V, M, pos, dO = inputs
    lens = seq_lens(c.S, c.P)
    to_layout = LAYOUT_FROM_BSHD[c.layout]
    seq_dim = to_layout.index(1)
    results = []
    for path in ("python", "cpp"):
        q, k, v = (shard(t.permute(to_layout), seq_dim, rank, lens).clone().requires_grad_() for t in (Q, K, V))
        m = None
        if M is not None:
            m = shard(M, M.dim() - 2, rank, lens).clone() if c.mask[2] == "sharded" else M.clone()
            m.requires_grad_(m.is_floating_point())
        p = shard(pos, 1, rank, lens) if pos is not None else None
        hq, hkv = (c.hq, c.hkv) if c.give_heads else (None, None)
        if path == "python":
            attn = ulysses.DistributedAttention(group, layout=c.layout, causal=c.causal, q_heads=hq, kv_heads=hkv,
                                                window=c.window or None, softcap=c.softcap or None)
            o = attn(q, k, v, mask=m, position_ids=p)
        else:
            o = ulysses._C.cpp_distributed_attention(q, k, v, m, p, group, 60_000, hq or 0, hkv or 0, c.layout,
                                                     c.causal, 0.0, "auto", c.window, c.softcap)
        (o * shard(dO.permute(to_layout), seq_dim, rank, lens)).sum().backward()
        results.append([o.detach(), q.grad, k.grad, v.grad, m.grad if m is not None and m.requires_grad else None])
    return results


@pytest.mark.parametrize("P", [1, 2, 3])
def test_python_module_and_cpp_api_are_bit_identical(P):
    configs = random_configs(P, CONFIGS_PER_P, random.Random(77 + P))
    prepared = [reference(c)[0] for c in configs]

    def body(rank, group):
        return [run_both(c, inputs, rank, group) for c, inputs in zip(configs, prepared)]

    for rank_results in run_ranks(P, body, timeout_s=60):
        for i, (python, cpp) in enumerate(rank_results):
            for j, (a, b) in enumerate(zip(python, cpp)):
                assert (a is None) == (b is None), (i, configs[i], j)
                if a is not None:
                    assert torch.equal(a, b), (i, configs[i], "output" if j == 0 else f"grad {j}")
