"""Head parts from Python: q, k, v projected per destination rank (ulysses.project_head_parts),
DistributedAttention.forward_parts, o's parts through the output projection
(ulysses.project_from_head_parts), against the same layer on whole tensors, forward and
backward, eager and compiled; the parts ops against the whole-tensor ops; the projections
overlapped with the exchanges (ulysses.scatter_projected, ulysses.gather_projected) likewise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ulysses
from conftest import run_ranks, run_ranks_errors, seq_lens


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def layer_inputs(S, E, hq, hkv, D, rank, lens):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, S, E, generator=gen)
    weights = [torch.randn(h * D, E, generator=gen) / E**0.5 for h in (hq, hkv, hkv)]
    weights.append(torch.randn(E, hq * D, generator=gen) / (hq * D) ** 0.5)
    start = sum(lens[:rank])
    return x[:, start:start + lens[rank]], weights


def whole_layer(attn, x, wq, wk, wv, wo, D, lens):
    q, k, v = (F.linear(x, w).unflatten(-1, (-1, D)) for w in (wq, wk, wv))
    return F.linear(attn(q, k, v, seq_lens=lens).flatten(-2), wo)


def parts_layer(attn, x, wq, wk, wv, wo, plan, lens):
    q = ulysses.project_head_parts(x, wq, None, plan["q_ranges"])
    k = ulysses.project_head_parts(x, wk, None, plan["kv_ranges"])
    v = ulysses.project_head_parts(x, wv, None, plan["kv_ranges"])
    return ulysses.project_from_head_parts(attn.forward_parts(q, k, v, seq_lens=lens), wo,
                                           plan["q_ranges"])


def projected_layer(attn, x, wq, wk, wv, wo, hq, hkv, plan, lens, rank):
    """The layer with its projections overlapped with the exchanges; local attention on this
    rank's heads (attn: unused, for the same call shape as the others)."""
    q, k, v = ulysses.scatter_projected(x, [wq, wk, wv], [None, None, None], ["q", "kv", "kv"], hq, hkv,
                                        lens, group=attn.group_name)
    kv_map = plan["kv_map"][rank]
    o = ulysses.local_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kv_map,
                                causal=True).transpose(1, 2)
    return ulysses.gather_projected(o, wo, hq, hkv, lens, group=attn.group_name)


@pytest.mark.parametrize("world,S,hq,hkv", [(2, 9, 6, 3), (3, 13, 6, 2), (4, 10, 8, 2)])
def test_parts_and_projected_layers_match_forward(world, S, hq, hkv):
    E, D = 12, 4
    lens = seq_lens(S, world)

    def body(rank, group):
        x, weights = layer_inputs(S, E, hq, hkv, D, rank, lens)
        plan = ulysses.plan(hq, hkv, world)
        attn = ulysses.DistributedAttention(group, q_heads=hq, kv_heads=hkv, causal=True)
        results = []
        for layer in (lambda *a: whole_layer(*a, D, lens), lambda *a: parts_layer(*a, plan, lens),
                      lambda *a: projected_layer(*a, hq, hkv, plan, lens, rank)):
            xs = x.clone().requires_grad_()
            ws = [w.clone().requires_grad_() for w in weights]
            out = layer(attn, xs, *ws)
            (out * torch.arange(out.numel()).view(out.shape).sin()).sum().backward()
            # Weight gradients are this rank's tokens' share in every form.
            results.append([out.detach(), xs.grad] + [w.grad for w in ws])
        return max(rel(a, b) for other in results[1:] for a, b in zip(other, results[0]))

    assert max(run_ranks(world, body)) < 1e-5


def test_projected_ops_fail_alike_when_one_rank_is_wrong():
    world, hq, hkv, E, D = 2, 4, 2, 8, 4
    lens = seq_lens(6, world)

    def body(rank, group):
        x = torch.randn(1, lens[rank], E)
        wk = torch.randn((hkv * D if rank == 0 else hkv * D + 1), E)  # rank 1's is not whole heads
        ulysses.scatter_projected(x, [torch.randn(hq * D, E), wk], [None, None], ["q", "kv"], hq, hkv,
                                  lens, group=group)

    errors = run_ranks_errors(world, body)
    assert errors[0] == errors[1] != ""
    assert "projection 1's weight must be [2 kv heads x D, 8]; got [9, 8]" in errors[0]


def test_parts_ops_match_whole_tensor_ops():
    world, S, hq, hkv, D = 3, 10, 6, 2, 4
    lens = seq_lens(S, world)

    def body(rank, group):
        plan = ulysses.plan(hq, hkv, world)
        gen = torch.Generator().manual_seed(rank)
        q, k = torch.randn(1, lens[rank], hq, D, generator=gen), torch.randn(1, lens[rank], hkv, D, generator=gen)
        split = [[x[:, :, a:b] for a, b in plan[key]] for x, key in ((q, "q_ranges"), (k, "kv_ranges"))]
        whole = ulysses.scatter_heads([q, k], ["q", "kv"], hq, hkv, lens, group=group)
        parts = ulysses.scatter_head_parts(split, ["q", "kv"], hq, hkv, lens, group=group)
        assert all(torch.equal(a, b) for a, b in zip(whole, parts))
        back = ulysses.gather_head_parts([whole[0]], ["q"], hq, hkv, lens, group=group)[0]
        assert torch.equal(torch.cat(back, 2), q)

    run_ranks(world, body)


def test_wrong_part_on_one_rank_fails_alike():
    lens = seq_lens(6, 2)

    def body(rank, group):
        attn = ulysses.DistributedAttention(group, q_heads=4, kv_heads=2)
        q = [torch.randn(1, lens[rank], 2 if rank == 0 else 1, 8), torch.randn(1, lens[rank], 2, 8)]
        kv = [torch.randn(1, lens[rank], 1, 8)] * 2
        attn.forward_parts(q, kv, kv, seq_lens=lens)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] != ""
    assert "scatter_head_parts: q part 0 must be 4-D (BSHD) with 2 heads in dim 2" in errors[0]


@pytest.mark.parametrize("form", ["parts", "projected"])
def test_layer_compiles_to_the_eager_result(form):
    world, S, hq, hkv, E, D = 2, 9, 4, 2, 8, 4
    lens = seq_lens(S, world)

    def body(rank, group):
        x, weights = layer_inputs(S, E, hq, hkv, D, rank, lens)
        plan = ulysses.plan(hq, hkv, world)
        attn = ulysses.DistributedAttention(group, q_heads=hq, kv_heads=hkv, causal=True)
        layer, extra = ((parts_layer, (plan, lens)) if form == "parts"
                        else (projected_layer, (hq, hkv, plan, lens, rank)))

        def loss_and_grads(fn):
            xs = x.clone().requires_grad_()
            ws = [w.clone().requires_grad_() for w in weights]
            fn(attn, xs, *ws, *extra).square().sum().backward()
            return [xs.grad] + [w.grad for w in ws]

        eager = loss_and_grads(layer)
        compiled = loss_and_grads(torch.compile(layer, backend="aot_eager", fullgraph=True))
        return max(rel(a, b) for a, b in zip(eager, compiled))

    assert max(run_ranks(world, body, timeout_s=120)) < 1e-6


def test_projections_check_their_shapes_as_the_cpp_api_does():
    import ulysses

    # A weight whose rows are not a whole number of heads per range: refused, not misshaped.
    with pytest.raises(ValueError, match=r"project_head_parts: need x \[B, S, E\], weight \[H x D, E\]"):
        ulysses.project_head_parts(torch.randn(1, 4, 64), torch.randn(250, 64), None, [(0, 16), (16, 32)])
    parts = ulysses.project_head_parts(torch.randn(1, 4, 8), torch.randn(16, 8), None, [(0, 2), (2, 4)])
    with pytest.raises(ValueError, match="project_from_head_parts: part 1 must be"):
        ulysses.project_from_head_parts([parts[0], parts[1][:, :, :1]], torch.randn(8, 16), [(0, 2), (2, 4)])
