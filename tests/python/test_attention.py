"""ulysses.DistributedAttention on thread ranks vs a single-rank reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

import ulysses
from conftest import run_processes, run_ranks, run_ranks_errors, seq_lens, set_up_links, shard
from reference import reference_attention

CASES = [
    # (world, S, hq, hkv, mask kind, positions, causal)
    (1, 9, 4, 2, None, False, False),
    (2, 13, 4, 2, None, False, True),
    (2, 13, 15, 15, "bool_padding", False, False),  # uneven heads
    (3, 14, 6, 3, "float_learnable", False, False),  # GQA, uneven S
    (3, 10, 4, 1, "bool_per_head", False, True),     # MQA, kv replicated
    (4, 17, 8, 2, "float_full", True, True),         # packed documents
    (2, 12, 2, 1, "key_broadcast", True, False),
]


def make_mask(kind, B, hq, S, gen):
    if kind is None:
        return None
    if kind == "bool_padding":
        m = torch.ones(B, 1, S, S, dtype=torch.bool)
        m[0, :, :, S - 3:] = False  # right padding of batch 0
        return m
    if kind == "float_learnable":
        return torch.randn(B, 1, S, S, generator=gen)
    if kind == "bool_per_head":
        return torch.rand(B, hq, S, S, generator=gen) > 0.3
    if kind == "float_full":
        return torch.randn(1, hq, S, S, generator=gen)
    if kind == "key_broadcast":
        return torch.randn(B, 1, 1, S, generator=gen)
    raise AssertionError(kind)


def positions_for(S):
    # Three packed documents with global positions restarting at 0.
    cut = [0, S // 3, S // 3 + S // 4, S]
    return torch.cat([torch.arange(cut[i + 1] - cut[i]) for i in range(3)]).unsqueeze(0).expand(2, S)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("world,S,hq,hkv,mask_kind,packed,causal", CASES)
def test_matches_single_rank_reference(world, S, hq, hkv, mask_kind, packed, causal):
    B, D = 2, 8
    gen = torch.Generator().manual_seed(world * 100 + S)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen) for h in (hq, hkv, hkv))
    M = make_mask(mask_kind, B, hq, S, gen)
    pos = positions_for(S) if packed else None
    learn_mask = M is not None and M.is_floating_point()

    # Reference: full tensors on one rank.
    q, k, v = (t.clone().double().requires_grad_() for t in (Q, K, V))
    m = M.clone().double().requires_grad_() if learn_mask else M
    ref = reference_attention(q, k, v, m, pos, causal)
    dO = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * dO).sum().backward()

    lens = seq_lens(S, world)
    sharded_rows = mask_kind in ("bool_padding", "float_learnable", "bool_per_head")

    def body(rank, group):
        attn = ulysses.DistributedAttention(group, causal=causal)
        ql, kl, vl = (shard(t, 1, rank, lens).clone().requires_grad_() for t in (Q, K, V))
        ml = None
        if M is not None:
            ml = shard(M, 2, rank, lens).clone() if sharded_rows else M.clone()
            if learn_mask:
                ml.requires_grad_()
        pl = shard(pos, 1, rank, lens) if packed else None
        o = attn(ql, kl, vl, mask=ml, position_ids=pl)
        (o * shard(dO, 1, rank, lens).float()).sum().backward()
        return o.detach(), ql.grad, kl.grad, vl.grad, (ml.grad if learn_mask else None)

    results = run_ranks(world, body)
    out = torch.cat([r[0] for r in results], 1)
    assert rel(out, ref) < 1e-5
    for i, full in ((1, q.grad), (2, k.grad), (3, v.grad)):
        assert rel(torch.cat([r[i] for r in results], 1), full) < 1e-4, f"grad {i}"
    if learn_mask:
        if sharded_rows:
            dm = torch.cat([r[4] for r in results], 2)
        else:  # a full mask is an input of every rank: its gradient is the sum over ranks
            dm = sum(r[4] for r in results)
        assert rel(dm, m.grad) < 1e-4


def test_two_modules_with_different_head_counts_interleave():
    S, D = 10, 4
    gen = torch.Generator().manual_seed(3)
    A = [torch.randn(1, S, h, D, generator=gen) for h in (6, 3, 3)]
    B = [torch.randn(1, S, h, D, generator=gen) for h in (4, 4, 4)]
    ref_a, ref_b = reference_attention(*A), reference_attention(*B)
    lens = seq_lens(S, 2)

    def body(rank, group):
        first = ulysses.DistributedAttention(group)  # heads captured from its first call
        second = ulysses.DistributedAttention(group, q_heads=4, kv_heads=4)
        outs = []
        for _ in range(2):
            outs.append(first(*(shard(t, 1, rank, lens) for t in A)))
            outs.append(second(*(shard(t, 1, rank, lens) for t in B)))
        assert (first.q_heads, first.kv_heads) == (6, 3)
        return outs

    results = run_ranks(2, body)
    for i, ref in enumerate([ref_a, ref_b, ref_a, ref_b]):
        assert rel(torch.cat([r[i] for r in results], 1), ref) < 1e-5


def test_shared_mask_is_rebuilt_once_per_step():
    S, hq, D = 8, 4, 4
    gen = torch.Generator().manual_seed(5)
    lens = seq_lens(S, 2)
    X = [torch.randn(1, S, hq, D, generator=gen) for _ in range(3)]
    M = torch.rand(1, 1, S, S, generator=gen) > 0.2

    def body(rank, group):
        layers = [ulysses.DistributedAttention(group, q_heads=hq) for _ in range(3)]
        x = [shard(t, 1, rank, lens) for t in X]
        mask = shard(M, 2, rank, lens)
        # Without a step first: a call without one after the step would miss the group's armed
        # agreement once (Note [Reused agreement]).
        set_up_links(group, 2)
        before = ulysses._C.collective_count(group)
        for layer in layers:
            layer(*x, mask=mask, seq_lens=lens)
        without = ulysses._C.collective_count(group) - before
        step = ulysses.StepContext()
        before = ulysses._C.collective_count(group)
        for layer in layers:
            layer(*x, mask=mask, seq_lens=lens, step=step)
        with_step = ulysses._C.collective_count(group) - before
        return with_step, without, step.reuses, step.agreements_reused

    for with_step, without, reuses, agreements in run_ranks(2, body):
        assert reuses == 2 and agreements == 2
        # Each mask rebuild is 2 collectives (agreement + all-gather), and each later layer's
        # agreement round 1: saved twice each with the step.
        assert without - with_step == 2 * 2 + 2


def test_one_rank_with_wrong_heads_fails_alike_on_every_rank():
    S, D = 8, 4
    lens = seq_lens(S, 2)

    def body(rank, group):
        attn = ulysses.DistributedAttention(group, q_heads=4, kv_heads=2)
        hkv = 2 if rank == 0 else 1
        q = torch.randn(1, lens[rank], 4, D)
        kv = torch.randn(1, lens[rank], hkv, D)
        attn(q, kv, kv)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] != ""
    assert "must have 2 kv heads" in errors[0]


def test_too_few_heads_is_a_clear_error():
    def body(rank, group):
        ulysses.DistributedAttention(group, q_heads=1)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1]
    assert "query heads (1) must be >= sequence-parallel size (2)" in errors[0]


def test_kv_heads_omitted_are_taken_from_k():
    def body(rank, group):
        attn = ulysses.DistributedAttention(group, q_heads=4)
        q, kv = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8)
        assert attn(q, kv, kv).shape == q.shape
        return attn.q_heads, attn.kv_heads

    assert run_ranks(2, body) == [(4, 2), (4, 2)]
    with pytest.raises(ValueError, match="q_heads must be >= 1"):
        ulysses.DistributedAttention("unused", q_heads=-1)


def _mesh_body(rank, group, Q, K, V, dO, lens):
    """Every entry point takes the SP group as a 1-D DeviceMesh (mesh["sp"]); a 2-D mesh is
    refused, naming its dims."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    attn = ulysses.DistributedAttention(mesh["sp"], causal=True)
    ql, kl, vl = (shard(t, 1, rank, lens).clone().requires_grad_() for t in (Q, K, V))
    o = attn(ql, kl, vl)
    (o * shard(dO, 1, rank, lens)).sum().backward()
    gathered = ulysses.all_gather_sequence(ql.detach(), 1, lens, mesh["sp"])
    backend = ulysses.autosp(mesh["sp"])
    flat = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "sp"))
    try:
        ulysses.DistributedAttention(flat)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return (o.detach(), ql.grad, kl.grad, vl.grad, torch.equal(gathered, Q), backend.size, refused,
            attn.group_name == mesh["sp"].get_group().group_name)


def test_device_mesh_is_a_group(tmp_path):
    world, S, B, D = 2, 7, 1, 8
    gen = torch.Generator().manual_seed(5)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen) for h in (4, 2, 2))
    q, k, v = (t.clone().double().requires_grad_() for t in (Q, K, V))
    ref = reference_attention(q, k, v, causal=True)
    dO = torch.randn(ref.shape, generator=gen)
    (ref * dO.double()).sum().backward()
    lens = seq_lens(S, world)
    results = run_processes(world, _mesh_body, Q, K, V, dO, lens, tmp_dir=str(tmp_path))
    assert rel(torch.cat([r[0] for r in results], 1), ref) < 1e-5
    for i, full in ((1, q.grad), (2, k.grad), (3, v.grad)):
        assert rel(torch.cat([r[i] for r in results], 1), full) < 1e-4, f"grad {i}"
    for r in results:
        assert r[4] and r[5] == world and r[7]
        assert "a DeviceMesh group must be 1-D (e.g. mesh['sp']) or a (mesh, dim) pair; got a 2-D mesh " \
               "with dims ('dp', 'sp')" in r[6], r[6]


@pytest.mark.parametrize("kernel", ["fused", "sdpa", "math"])
@pytest.mark.parametrize("window", [1, 7, 20, 40])
@pytest.mark.parametrize("packed", [False, True], ids=["", "packed"])
def test_sliding_window_matches_the_reference(kernel, window, packed):
    # Windows 1, S/3, S-1 and > S (S = 21), forward and backward, on each local kernel.
    B, S, hq, hkv, D = 2, 21, 4, 2, 8
    gen = torch.Generator().manual_seed(window)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    pos = positions_for(S) if packed else None
    dtype = torch.float32 if kernel == "fused" else torch.float64
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    ref = reference_attention(q, k, v, None, pos, causal=True, window=window)
    dO = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * dO).sum().backward()
    ql, kl, vl = (t.to(dtype).transpose(1, 2).detach().requires_grad_() for t in (Q, K, V))
    out = ulysses.local_attention(ql, kl, vl, [h // (hq // hkv) for h in range(hq)], positions=pos,
                                  causal=True, kernel=kernel, window=window).transpose(1, 2)
    (out * dO.to(dtype)).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert rel(out, ref) < tol
    for got, want in ((ql, q), (kl, k), (vl, v)):  # (window 1: dq = dk = 0, so scaled by 1)
        error = (got.grad.transpose(1, 2).double() - want.grad).abs().max()
        assert error < 10 * tol * max(want.grad.abs().max().item(), 1.0)


def test_a_window_without_causal_is_refused():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="a sliding window is a causal rule"):
        ulysses.local_attention(q, q, q, [0, 1], window=3)


@pytest.mark.parametrize("kernel", ["fused", "math"])
@pytest.mark.parametrize("causal", [False, True])
def test_logit_softcap_matches_the_reference(kernel, causal):
    # Scores of size ~3 against a cap of 1.5: capped hard. A learnable bias is added after the
    # cap, so its gradient is that of the capped scores (no tanh slope).
    B, S, hq, hkv, D = 2, 70, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) * 2 for h in (hq, hkv, hkv))
    M = torch.randn(B, 1, S, S, generator=gen, dtype=torch.float64)
    q, k, v, m = (t.clone().requires_grad_() for t in (Q, K, V, M))
    ref = reference_attention(q, k, v, m, None, causal=causal, softcap=1.5)
    dO = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * dO).sum().backward()
    dtype = torch.float32 if kernel == "fused" else torch.float64
    ql, kl, vl = (t.to(dtype).transpose(1, 2).detach().requires_grad_() for t in (Q, K, V))
    ml = M.to(dtype).requires_grad_()
    out = ulysses.local_attention(ql, kl, vl, [h // (hq // hkv) for h in range(hq)], ml, causal=causal,
                                  kernel=kernel, softcap=1.5).transpose(1, 2)
    (out * dO.to(dtype)).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert rel(out, ref) < tol
    for got, want in ((ql.grad.transpose(1, 2), q.grad), (kl.grad.transpose(1, 2), k.grad),
                      (vl.grad.transpose(1, 2), v.grad), (ml.grad, m.grad)):
        assert rel(got, want) < 10 * tol
    uncapped = reference_attention(Q, K, V, M, None, causal=causal)
    assert rel(uncapped, ref) > 1e-2  # the cap matters here


def test_autocast_runs_attention_in_its_dtype():
    # Under autocast a model's q (fp32 after RoPE) meets a bf16 v: attention runs in bf16, as
    # torch's SDPA does, and matches the reference on the same bf16 inputs (forward and dq).
    B, S, hq, hkv, D = 2, 11, 4, 2, 8
    gen = torch.Generator().manual_seed(5)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen) for h in (hq, hkv, hkv))
    q16, k16, v16 = (t.bfloat16().double().requires_grad_() for t in (Q, K, V))
    ref = reference_attention(q16, k16, v16, causal=True)
    ref.sum().backward()
    lens = seq_lens(S, 2)

    def body(rank, group):
        q = shard(Q, 1, rank, lens).requires_grad_()
        k, v = (shard(t, 1, rank, lens).bfloat16() for t in (K, V))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = ulysses.DistributedAttention(group, causal=True)(q, k, v)
        o.float().sum().backward()
        return o, q.grad

    results = run_ranks(2, body)
    assert all(o.dtype == torch.bfloat16 for o, _ in results)
    assert rel(torch.cat([o for o, _ in results], 1), ref) < 2e-2
    assert rel(torch.cat([g for _, g in results], 1), q16.grad) < 5e-2
    with pytest.raises(Exception, match="v is BFloat16 but q is Float"):  # without autocast: refused
        run_ranks(2, lambda rank, group: ulysses.DistributedAttention(group)(
            shard(Q, 1, rank, lens), shard(K, 1, rank, lens), shard(V, 1, rank, lens).bfloat16()))


@pytest.mark.parametrize("kernel", ["fused", "math"])
@pytest.mark.parametrize("window,packed", [(0, False), (0, True), (5, False), (5, True)])
def test_attention_sinks_match_the_reference(kernel, window, packed):
    # gpt-oss's sinks: one logit per head in every row's denominator; forward and every
    # gradient (the sinks' and a learnable mask's too) against float64.
    B, S, hq, hkv, D = 2, 19, 4, 2, 8
    gen = torch.Generator().manual_seed(window + 10 * packed)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    M = torch.randn(B, 1, S, S, generator=gen, dtype=torch.float64)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) + 1.0
    pos = positions_for(S) if packed else None
    leaves = [t.clone().requires_grad_() for t in (Q, K, V, M, sinks)]
    ref = reference_attention(*leaves[:3], leaves[3], pos, causal=True, window=window, sinks=leaves[4])
    dO = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * dO).sum().backward()
    ours = [t.float().detach().requires_grad_() for t in (Q, K, V, M, sinks)]
    ql, kl, vl = (t.transpose(1, 2) for t in ours[:3])
    out = ulysses.local_attention(ql, kl, vl, [h // (hq // hkv) for h in range(hq)], mask=ours[3], positions=pos,
                                  causal=True, kernel=kernel, window=window, sinks=ours[4]).transpose(1, 2)
    (out * dO.float()).sum().backward()
    assert rel(out, ref) < 1e-5
    assert rel(out, reference_attention(Q, K, V, M, pos, causal=True, window=window)) > 1e-2  # sinks matter
    for name, got, want in zip("q k v mask sinks".split(), ours, leaves):
        assert rel(got.grad, want.grad) < 1e-4, name


@pytest.mark.parametrize("world", [2, 3, 4])
def test_attention_sinks_are_exact_over_ranks_and_uneven_heads(world):
    # 6 query heads over 4 ranks (uneven), GQA 6/3, packed documents, uneven S: output and the
    # gradients of q, k, v and the sinks (each rank's holds its heads; summed over the group).
    B, S, hq, hkv, D = 2, 17, 6, 3, 8
    gen = torch.Generator().manual_seed(world)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen)
    pos = positions_for(S)
    leaves = [t.double().requires_grad_() for t in (Q, K, V, sinks)]
    ref = reference_attention(*leaves[:3], None, pos, causal=True, sinks=leaves[3])
    ref.square().sum().backward()
    lens = seq_lens(S, world)

    def body(rank, group):
        q, k, v = (shard(t, 1, rank, lens).requires_grad_() for t in (Q, K, V))
        s = sinks.clone().requires_grad_()
        o = ulysses.DistributedAttention(group, causal=True)(q, k, v, position_ids=shard(pos, 1, rank, lens),
                                                             sinks=s)
        o.square().sum().backward()
        return o, q.grad, k.grad, v.grad, s.grad

    results = run_ranks(world, body)
    for i, want in enumerate(leaves[:3]):
        got = torch.cat([r[1 + i] for r in results], 1)
        assert rel(got, want.grad) < 1e-4, (world, "qkv"[i])
    assert rel(torch.cat([r[0] for r in results], 1), ref) < 1e-5
    assert rel(sum(r[4] for r in results), leaves[3].grad) < 1e-4
    assert all((r[4] != 0).sum() < hq for r in results)  # each rank's: its heads only


def test_sinks_on_one_rank_only_fail_alike():
    S = 8
    Q = torch.randn(1, S, 4, 8)
    lens = seq_lens(S, 2)
    errors = run_ranks_errors(2, lambda rank, group: ulysses.DistributedAttention(group)(
        *(shard(Q, 1, rank, lens) for _ in range(3)), sinks=torch.zeros(4) if rank == 1 else None))
    assert len(set(errors)) == 1 and "ranks disagree on whether sinks is given" in errors[0], errors
