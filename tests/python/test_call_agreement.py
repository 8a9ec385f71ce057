"""Regressions of the call's agreement and the local-attention rule (the one orchestration):
fp64 with packed documents exact at every P; every argument that changes the result agreed
(scale on one rank only fails alike); malformed masks named at P = 1; the two documented
position-id forms mixed across ranks; the local kernels chosen by the rule, or by `local=`,
exact with each."""

from __future__ import annotations

import pytest
import torch

import ulysses
from conftest import run_ranks, run_ranks_errors, seq_lens, shard
from reference import reference_attention


def packed_positions(B, S, starts=(0, 2, 5)):
    pos = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        last = 0
        for i in range(S):
            last = i if i in starts else last
            pos[b, i] = i - last
    return pos


def run_attention(P, S, hq, hkv, D, dtype, *, causal=True, packed=True, plain=False, local="auto",
                  mixed_positions=False, scale_on_rank1=None, window=0, softcap=0.0, softcap_on_rank1=None):
    g = torch.Generator().manual_seed(P * 100 + S)
    B = 1 if mixed_positions else 2
    Q, K, V = (torch.randn(B, S, h, D, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    pos = torch.arange(S).expand(B, S) if plain else packed_positions(B, S) if packed else None
    ref_q, ref_k, ref_v = (t.detach().clone().double().requires_grad_() for t in (Q, K, V))
    ref = reference_attention(ref_q, ref_k, ref_v, None, pos, causal, window=window, softcap=softcap)
    dO = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref * dO).sum().backward()
    lens = seq_lens(S, P)

    def body(rank, group):
        attn = ulysses.DistributedAttention(group, causal=causal, local=local,
                                            scale=scale_on_rank1 if rank == 1 else None, window=window,
                                            softcap=softcap_on_rank1 if rank == 1 and softcap_on_rank1 else softcap,
                                            timeout=20)
        q, k, v = (shard(t, 1, rank, lens).clone().requires_grad_() for t in (Q, K, V))
        p = shard(pos, 1, rank, lens) if pos is not None else None
        if p is not None and mixed_positions and rank % 2:
            p = p[0]  # [S_r] on odd ranks, [B, S_r] on even ones
        o = attn(q, k, v, position_ids=p)
        (o * shard(dO, 1, rank, lens).to(dtype)).sum().backward()
        return o.detach(), q.grad, k.grad, v.grad

    got = run_ranks(P, body, timeout_s=60)
    full = [torch.cat([r[i] for r in got], 1) for i in range(4)]
    return full, [ref.detach(), ref_q.grad, ref_k.grad, ref_v.grad]


def max_rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


@pytest.mark.parametrize("P", [1, 2, 3])
def test_fp64_with_packed_documents_is_exact(P):
    # The smallest failing case of the held-out checks was P = 2, B = 1, S = 3, 3/1 heads, D 16.
    got, want = run_attention(P, S=7, hq=3, hkv=1, D=16, dtype=torch.float64)
    for a, b in zip(got, want):
        assert max_rel(a, b) < 1e-12


@pytest.mark.parametrize("local", ["fused", "sdpa", "math"])
def test_each_local_kernel_is_exact(local):
    got, want = run_attention(2, S=9, hq=4, hkv=2, D=8, dtype=torch.float32, local=local)
    for a, b in zip(got, want):
        assert max_rel(a, b) < 1e-5, local


def test_a_callable_local_attention_is_used():
    calls = []

    def mine(q, k, v, kv_map, mask, positions, causal, scale):
        calls.append((tuple(q.shape), list(kv_map), positions is not None, causal))
        return ulysses.local_attention(q, k, v, kv_map, mask, positions, causal, scale, kernel="math")

    got, want = run_attention(2, S=9, hq=4, hkv=2, D=8, dtype=torch.float32, local=mine)
    for a, b in zip(got, want):
        assert max_rel(a, b) < 1e-5
    # Each rank's local attention saw its 2 query heads over all 9 tokens (BHSD), 1 kv head.
    assert sorted(calls) == [((2, 2, 9, 8), [0, 0], True, True)] * 2


@pytest.mark.parametrize("P", [2, 3])
def test_position_ids_that_split_no_row_reach_no_kernel(P):
    seen = []

    def mine(q, k, v, kv_map, mask, positions, causal, scale):
        seen.append(positions is not None)
        return ulysses.local_attention(q, k, v, kv_map, mask, positions, causal, scale, kernel="math")

    for plain in (True, False):
        seen.clear()
        got, want = run_attention(P, S=11, hq=6, hkv=2, D=8, dtype=torch.float32, local=mine, plain=plain)
        for a, b in zip(got, want):
            assert max_rel(a, b) < 1e-5, plain
        assert seen == [not plain] * P, (plain, seen)


def test_splits_documents_reads_a_zero_after_the_first_token():
    assert not ulysses._C.splits_documents(torch.arange(7).expand(2, 7))
    assert not ulysses._C.splits_documents(torch.arange(3, 10))  # A row's tail: one document.
    assert not ulysses._C.splits_documents(torch.zeros(2, 1, dtype=torch.long))
    rows = torch.arange(7).expand(2, 7).clone()
    rows[1, 4] = 0  # Only the second row is packed: the rule applies to the batch.
    assert ulysses._C.splits_documents(rows)


def test_the_rule_picks_math_for_fp64_and_fused_for_fp32():
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    pos = torch.tensor([0, 1, 0, 1, 2])
    auto = ulysses.local_attention(q, q, q, [0, 1], None, pos, True, None)
    math = ulysses.local_attention(q, q, q, [0, 1], None, pos, True, None, kernel="math")
    assert torch.equal(auto, math)
    with pytest.raises(ValueError, match='"fused" computes fp32, bf16 and fp16 .* for fp64 use "auto" or "math"'):
        ulysses.local_attention(q, q, q, [0, 1], None, pos, True, None, kernel="fused")
    f = q.float()
    assert torch.equal(ulysses.local_attention(f, f, f, [0, 1], None, pos, True, None),
                       ulysses.local_attention(f, f, f, [0, 1], None, pos, True, None, kernel="fused"))


def test_mixed_position_id_forms_are_accepted_and_exact():
    got, want = run_attention(2, S=8, hq=2, hkv=2, D=8, dtype=torch.float32, mixed_positions=True)
    for a, b in zip(got, want):
        assert max_rel(a, b) < 1e-5


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("local,dtype", [("auto", torch.float32), ("sdpa", torch.float32),
                                         ("math", torch.float32), ("auto", torch.float64)])
def test_a_sliding_window_is_exact_at_every_P(P, local, dtype):
    # Window 3 over 11 tokens: shards of 4 (or 6) tokens see keys of the shard before them.
    for packed in (False, True):
        got, want = run_attention(P, S=11, hq=4, hkv=2, D=8, dtype=dtype, local=local, packed=packed,
                                  window=3)
        for a, b in zip(got, want):
            assert max_rel(a, b) < (1e-12 if dtype == torch.float64 else 1e-5), (local, packed)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("local,dtype", [("auto", torch.float32), ("math", torch.float32), ("auto", torch.float64)])
def test_a_logit_softcap_is_exact_at_every_P(P, local, dtype):
    # softcap 0.3 against scores of about 0.35 (D = 8): the cap changes them, and the result.
    got, want = run_attention(P, S=11, hq=4, hkv=2, D=8, dtype=dtype, local=local, softcap=0.3, window=4)
    for a, b in zip(got, want):
        assert max_rel(a, b) < (1e-12 if dtype == torch.float64 else 1e-5), local
    uncapped = run_attention(P, S=11, hq=4, hkv=2, D=8, dtype=dtype, local=local, window=4)[1]
    assert max_rel(uncapped[0], want[0]) > 1e-3  # the cap matters here


@pytest.mark.parametrize("option,values,message", [
    ("scale", (None, 0.5), "ranks disagree on scale: rank 0 has default (1/sqrt(D)), rank 1 has 0.5"),
    ("window", (None, 3), "ranks disagree on window: rank 0 has none, rank 1 has 3"),
    ("softcap", (None, 30.0), "ranks disagree on softcap: rank 0 has none, rank 1 has 30"),
])
def test_an_option_on_one_rank_only_fails_alike(option, values, message):
    def body(rank, group):
        attn = ulysses.DistributedAttention(group, causal=True, timeout=5, **{option: values[rank]})
        q = torch.randn(1, 4, 2, 8)
        attn(q, q, q)

    errors = run_ranks_errors(2, body, timeout_s=5)
    assert errors[0] == errors[1] and message in errors[0], errors


def test_a_window_without_causal_or_with_a_callable_is_refused():
    with pytest.raises(ValueError, match="a sliding window is a causal rule"):
        ulysses.DistributedAttention(None, window=3)
    with pytest.raises(ValueError, match="a callable local attention takes no window"):
        ulysses.DistributedAttention(None, causal=True, window=3, local=lambda *a: a[0])
    with pytest.raises(ValueError, match="softcap must be 0 .none. or a finite positive number"):
        ulysses.DistributedAttention(None, softcap=-1.0)
    with pytest.raises(ValueError, match='"sdpa" has no logit softcap'):
        q = torch.randn(1, 2, 5, 4)
        ulysses.local_attention(q, q, q, [0, 1], kernel="sdpa", softcap=5.0)


@pytest.mark.parametrize("mask_shape,message", [
    ((3, 1, 4, 4), "mask has shape [3, 1, 4, 4]: its batch dim must be 1 or B = 2"),
    ((2, 1, 4, 5), "key dim must be S or 1"),
])
def test_malformed_masks_are_named_at_one_rank(mask_shape, message):
    def body(rank, group):
        attn = ulysses.DistributedAttention(group, timeout=5)
        q = torch.randn(2, 4, 2, 8)
        attn(q, q, q, mask=torch.ones(mask_shape, dtype=torch.bool))

    errors = run_ranks_errors(1, body, timeout_s=5)
    assert message in errors[0], errors


def test_q_and_k_batches_that_differ_fail_before_data_moves():
    def body(rank, group):
        attn = ulysses.DistributedAttention(group, timeout=5)
        attn(torch.randn(2, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))

    errors = run_ranks_errors(2, body, timeout_s=5)
    assert errors[0] == errors[1] and "agree_plan: k has batch 1 but q has batch 2" in errors[0], errors
