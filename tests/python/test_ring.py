"""Hybrid Ulysses x ring attention from Python (ulysses.DistributedAttention with ring_group) on
thread ranks vs a single-rank reference, forward and backward; its Python helpers."""

from __future__ import annotations

import pytest
import thread_groups
import torch

import ulysses
from conftest import run_ranks, run_ranks_errors
from reference import reference_attention


def hybrid_group_names(U: int, R: int):
    """For every SP rank p = r * U + u: (its Ulysses group's name, its ring group's name), and
    the group objects to keep alive."""
    ulysses_groups = [thread_groups.make_thread_groups(U) for _ in range(R)]
    ring_groups = [thread_groups.make_thread_groups(R) for _ in range(U)]
    names = [(ulysses_groups[p // U][0][p % U], ring_groups[p % U][0][p // U]) for p in range(U * R)]
    return names, (ulysses_groups, ring_groups)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def test_shard_sequence_is_the_zigzag_layout_and_round_trips():
    x = torch.arange(2 * 13).view(2, 13)
    shards = [ulysses.shard_sequence(x, 1, p, 4, ring=2) for p in range(4)]
    # 13 tokens in 4 chunks (4, 3, 3, 3): ring rank 0 holds chunks 0 and 3, ring rank 1 chunks 1 and 2.
    assert torch.cat(shards[:2], 1)[0].tolist() == [0, 1, 2, 3, 10, 11, 12]
    assert torch.cat(shards[2:], 1)[0].tolist() == [4, 5, 6, 7, 8, 9]
    index = torch.cat([ulysses.shard_sequence(torch.arange(13), 0, p, 4, ring=2) for p in range(4)])
    assert sorted(index.tolist()) == list(range(13))
    assert ulysses.shard_sequence(x, 1, 1, 2).tolist() == x[:, 7:].tolist()  # ring=1: contiguous
    with pytest.raises(ValueError, match="must divide"):
        ulysses.shard_sequence(x, 1, 0, 4, ring=3)


def test_plan_sp_mesh_lists_every_split_best_first():
    plans = ulysses.plan_sp_mesh(16, 32, 8, 32768)
    assert [(p["ulysses"], p["ring"]) for p in plans][0] == (16, 1)
    assert sorted(p["ulysses"] for p in plans) == [1, 2, 4, 8, 16]
    totals = [p["a2a_bytes"] + p["ring_bytes"] for p in plans]
    assert totals[0] == min(totals)
    # SP beyond the head count: only hybrid splits exist.
    assert all(p["ulysses"] <= 4 for p in ulysses.plan_sp_mesh(16, 4, 4, 1024))


@pytest.mark.parametrize("U,R,hq,hkv,S,causal,packed,mask_kind,window,sinks", [
    (2, 2, 6, 2, 13, True, True, None, 0, False),           # GQA, uneven S, causal packed documents
    (2, 2, 4, 2, 13, True, True, None, 3, False),           # sliding window: some blocks wholly outside
    (1, 3, 4, 2, 17, True, False, "learnable", 5, False),   # window with a learnable bias
    (2, 2, 4, 2, 13, False, False, "learnable", -1, False),  # logit softcap (window -1: cap 0.3 instead)
    (1, 2, 4, 4, 9, False, False, None, 0, False),          # pure ring
    (2, 2, 4, 1, 10, True, False, None, 0, False),          # MQA: kv replicated over U
    (2, 2, 4, 2, 11, True, False, "learnable", 0, False),   # float bias [B, 1, S_r, S] with gradient
    (1, 3, 4, 2, 10, False, False, "per_head", 0, False),   # bool [1, Hq, S, S], full rows
    (2, 2, 6, 2, 13, True, True, None, 0, True),     # attention sinks, packed documents
    (1, 3, 4, 2, 17, True, False, "learnable", 5, True),  # sinks with a window and a bias
])
def test_hybrid_matches_single_rank_reference(U, R, hq, hkv, S, causal, packed, mask_kind, window, sinks):
    B, D, P = 2, 8, U * R
    gen = torch.Generator().manual_seed(S)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen) for h in (hq, hkv, hkv))
    pos = torch.cat([torch.arange(5), torch.arange(S - 5)]).expand(B, S) if packed else None
    M = None
    if mask_kind == "learnable":
        M = torch.randn(B, 1, S, S, generator=gen)
    elif mask_kind == "per_head":
        M = torch.rand(1, hq, S, S, generator=gen) > 0.3
    learn = mask_kind == "learnable"
    q, k, v = (t.clone().double().requires_grad_() for t in (Q, K, V))
    m_ref = M.clone().double().requires_grad_() if learn else M
    window, softcap = (0, 0.3) if window < 0 else (window, 0.0)
    sink = torch.randn(hq, generator=gen, dtype=torch.float64).requires_grad_() if sinks else None
    ref = reference_attention(q, k, v, m_ref, pos, causal, window=window, softcap=softcap, sinks=sink)
    dO = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * dO).sum().backward()
    names, keep = hybrid_group_names(U, R)

    def body(p, _world):
        uly, ring = names[p]
        attn = ulysses.DistributedAttention(uly, ring_group=ring, causal=causal, window=window, softcap=softcap)
        cut = lambda t: ulysses.shard_sequence(t, 1, p, P, ring=R)  # noqa: E731
        ql, kl, vl = (cut(t).clone().requires_grad_() for t in (Q, K, V))
        ml = None
        if M is not None:  # A learnable bias by query rows (this shard's), the bool mask whole.
            ml = ulysses.shard_sequence(M, 2, p, P, ring=R).clone().requires_grad_() if learn else M
        sl = sink.detach().float().requires_grad_() if sinks else None
        o = attn(ql, kl, vl, mask=ml, position_ids=cut(pos) if packed else None, sinks=sl)
        (o * cut(dO).float()).sum().backward()
        return o.detach(), ql.grad, kl.grad, vl.grad, (ml.grad if learn else None), (sl.grad if sinks else None)

    results = run_ranks(P, body)
    full = lambda i: torch.zeros(B, S, *results[0][i].shape[2:], dtype=results[0][i].dtype)  # noqa: E731
    for i, want in ((0, ref), (1, q.grad), (2, k.grad), (3, v.grad)):
        got = full(i)
        for p in range(P):
            index = torch.tensor(ulysses._C.ring_shard_index(S, U, R, p))
            got[:, index] = results[p][i]
        assert rel(got, want) < 1e-4, f"output/grad {i}"
    if learn:
        got = torch.zeros(B, 1, S, S)
        for p in range(P):
            got[:, :, torch.tensor(ulysses._C.ring_shard_index(S, U, R, p))] = results[p][4]
        assert rel(got, m_ref.grad) < 1e-4, "mask grad"
    if sinks:  # Each rank's holds its heads' (summed over the whole SP group).
        assert rel(sum(r[5] for r in results), sink.grad) < 1e-4, "sinks grad"
    del keep


def test_hybrid_attention_in_head_chunks_is_the_whole_call():
    # Head chunks over the Ulysses group with a ring beside it, kept and recomputed (the ring's
    # chunks run their whole call again in backward): o and the gradients are the whole call's.
    U, R, hq, hkv, S, B, D = 2, 2, 4, 2, 13, 2, 8
    gen = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen) for h in (hq, hkv, hkv))
    names, keep = hybrid_group_names(U, R)

    def body(p, _world):
        uly, ring = names[p]
        outs = []
        for chunks, recompute in ((1, False), (2, False), (2, True)):
            attn = ulysses.DistributedAttention(uly, ring_group=ring, causal=True, head_chunks=chunks,
                                                recompute_chunks=recompute)
            ql, kl, vl = (ulysses.shard_sequence(t, 1, p, U * R, ring=R).clone().requires_grad_() for t in (Q, K, V))
            o = attn(ql, kl, vl)
            o.square().sum().backward()
            outs.append((o.detach(), ql.grad, kl.grad, vl.grad))
        return outs

    for whole, *chunked_runs in run_ranks(U * R, body):
        for chunked in chunked_runs:
            for got, want in zip(chunked, whole, strict=True):
                assert rel(got, want) < 1e-5
    del keep


def test_layers_sharing_a_step_rebuild_the_mask_and_documents_once():
    names, keep = hybrid_group_names(2, 2)
    S = 12

    def body(p, _world):
        uly, ring = names[p]
        layers = [ulysses.DistributedAttention(uly, ring_group=ring, causal=True) for _ in range(2)]
        cut = lambda t, d=1: ulysses.shard_sequence(t, d, p, 4, ring=2)  # noqa: E731
        x = cut(torch.randn(1, S, 4, 8, generator=torch.Generator().manual_seed(1)))
        bias = cut(torch.randn(1, 1, S, S, generator=torch.Generator().manual_seed(2)), 2)
        pos = cut(torch.cat([torch.arange(5), torch.arange(S - 5)]).unsqueeze(0))
        step = ulysses.StepContext()
        outs = [layer(x, x, x, mask=bias, position_ids=pos, step=step) for layer in layers]
        return step.reuses, torch.equal(outs[0], outs[1]), torch.equal(outs[0], layers[0](x, x, x, mask=bias,
                                                                                          position_ids=pos))

    for reuses, same, same_without_step in run_ranks(4, body):
        assert reuses == 3 and same and same_without_step  # mask, gathered positions, documents
    del keep


@pytest.mark.parametrize("U,R", [(1, 2), (2, 2)])
def test_one_rank_with_a_key_sharded_mask_fails_every_rank_alike(U, R):
    names, keep = hybrid_group_names(U, R)
    P, S = U * R, 8

    def body(p, _world):
        uly, ring = names[p]
        attn = ulysses.DistributedAttention(uly, ring_group=ring)
        x = ulysses.shard_sequence(torch.randn(1, S, 2, 4), 1, p, P, ring=R)
        keys = x.shape[1] if p == P - 1 else S  # the last rank's mask covers only its own keys
        attn(x, x, x, mask=torch.ones(1, 1, x.shape[1], keys, dtype=torch.bool))

    errors = run_ranks_errors(P, body)
    assert all(errors) and len(set(errors)) == 1, errors
    assert "key" in errors[0], errors[0]
    del keep
