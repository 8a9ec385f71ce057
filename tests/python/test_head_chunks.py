"""Attention in chunks of heads (DistributedAttention(head_chunks=k)): the plan, exactness
against the whole call (forward and backward) for every rule, and the refusals."""

from __future__ import annotations

import re

import pytest
import torch

import ulysses
from conftest import run_ranks, run_ranks_errors, seq_lens, shard
from reference import reference_attention
from test_attention import make_mask, positions_for, rel
from ulysses import _C


def test_a_chunk_is_a_block_of_kv_heads_with_their_query_heads():
    # Llama-8B's heads over 4 ranks in 2 chunks: 4 kv heads and their 16 query heads each, so
    # each chunk's partition still gives every rank one kv head of its own (no replication).
    assert _C.head_chunks(32, 8, 4, 2) == [((0, 16), (0, 4)), ((16, 32), (4, 8))]
    assert _C.plan(16, 4, 4)["kv_heads"] == [1, 1, 1, 1]
    assert _C.head_chunks(15, 15, 2, 4) == [((0, 4), (0, 4)), ((4, 8), (4, 8)), ((8, 12), (8, 12)),
                                            ((12, 15), (12, 15))]


@pytest.mark.parametrize("hq,hkv,P,k", [(15, 15, 2, 4), (12, 6, 4, 3), (8, 2, 2, 2), (4, 4, 3, 1)])
def test_chunks_cover_every_head_once_and_keep_kv_groups_whole(hq, hkv, P, k):
    chunks = _C.head_chunks(hq, hkv, P, k)
    assert len(chunks) == k
    assert [c[0][0] for c in chunks[1:]] == [c[0][1] for c in chunks[:-1]] and chunks[-1][0][1] == hq
    assert [c[1][0] for c in chunks[1:]] == [c[1][1] for c in chunks[:-1]] and chunks[-1][1][1] == hkv
    for (qb, qe), (kb, ke) in chunks:  # a chunk's query heads are exactly those of its kv heads
        assert (qb, qe) == (kb * hq // hkv, ke * hq // hkv) and qe - qb >= P


@pytest.mark.parametrize("hq,hkv,P,k,message", [
    (8, 2, 2, 4, "4 chunks of an attention with 2 kv heads; give 1 to 2"),
    (4, 1, 2, 2, "2 chunks of an attention with 1 kv heads; give 1 to 1"),
    (6, 3, 4, 3, "leave a chunk with 2, fewer than the 4 ranks"),
    (4, 4, 2, 0, "0 chunks"),
])
def test_chunk_counts_that_cannot_be_made_are_refused(hq, hkv, P, k, message):
    with pytest.raises(ValueError, match=message):
        _C.head_chunks(hq, hkv, P, k)


CASES = [
    # (world, S, hq, hkv, chunks, mask kind, packed, causal, window, softcap, sinks)
    (2, 13, 4, 2, 2, None, False, True, 0, 0.0, False),
    (2, 13, 15, 15, 4, "bool_padding", False, False, 0, 0.0, False),  # uneven heads
    (3, 14, 12, 6, 2, "float_learnable", False, False, 0, 0.0, False),  # GQA, uneven S
    (2, 10, 8, 2, 2, "bool_per_head", False, True, 0, 0.0, True),      # per-head mask, sinks
    (4, 17, 8, 4, 2, "float_full", True, True, 5, 0.0, False),        # documents, window
    (2, 12, 4, 2, 2, "key_broadcast", True, False, 0, 20.0, True),     # softcap, sinks
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("world,S,hq,hkv,chunks,mask_kind,packed,causal,window,softcap,use_sinks", CASES)
def test_chunked_attention_is_the_whole_call(world, S, hq, hkv, chunks, mask_kind, packed, causal, window,
                                             softcap, use_sinks, dtype):
    # The same thread ranks run the call whole, in chunks, and in chunks run again in backward
    # (recompute_chunks): o and the gradients of q, k, v, a learnable mask and the sinks agree
    # to rounding, and all match the reference. float64 runs the math kernel (recomputed: the
    # whole call again); float32 the fused one (recomputed: the kernel's backward from the saved
    # log-sum-exp and o sent to heads again), whose gradients are the kept chunks' bit for bit.
    B, D = 2, 8
    close, to_ref = (1e-13, 1e-10) if dtype == torch.float64 else (1e-5, 1e-4)
    gen = torch.Generator().manual_seed(world * 100 + S + chunks)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen, dtype=dtype) for h in (hq, hkv, hkv))
    M = make_mask(mask_kind, B, hq, S, gen)
    M = M.to(dtype) if M is not None and M.is_floating_point() else M
    sinks = torch.randn(hq, generator=gen, dtype=dtype) if use_sinks else None
    pos = positions_for(S) if packed else None
    lens = seq_lens(S, world)
    ref = reference_attention(Q, K, V, M, pos, causal=causal, window=window, softcap=softcap, sinks=sinks)

    def run(rank, group, k, recompute=False):
        q, k_, v = (shard(t, 1, rank, lens).clone().requires_grad_() for t in (Q, K, V))
        m = None
        if M is not None:
            m = M if M.shape[2] == 1 else shard(M, 2, rank, lens)
            m = m.clone().requires_grad_() if m.is_floating_point() else m
        s = sinks.clone().requires_grad_() if sinks is not None else None
        attention = ulysses.DistributedAttention(group, causal=causal, window=window or None,
                                                 softcap=softcap or None, head_chunks=k,
                                                 recompute_chunks=recompute)
        o = attention(q, k_, v, mask=m, position_ids=shard(pos, 1, rank, lens) if pos is not None else None,
                      sinks=s)
        o.square().sum().backward()
        # A mask held whole and the sinks: each rank's gradient holds its heads' share (the
        # chunks split heads otherwise), so their sums over the group are compared.
        learnt = m is not None and m.requires_grad
        whole_mask = learnt and M.shape[2] == 1
        own = [q.grad, k_.grad, v.grad] + ([m.grad] if learnt and not whole_mask else [])
        shared = ([m.grad] if whole_mask else []) + ([s.grad] if s is not None else [])
        return o.detach(), own, shared

    def body(rank, group):
        return run(rank, group, 1), run(rank, group, chunks), run(rank, group, chunks, recompute=True)

    results = run_ranks(world, body)
    for whole, kept, recomputed in results:
        for chunked in (kept, recomputed):
            assert rel(chunked[0], whole[0]) < close
            for got, want in zip(chunked[1], whole[1], strict=True):
                assert rel(got, want) < close
        if dtype == torch.float32:
            for got, want in zip(recomputed[1] + recomputed[2], kept[1] + kept[2], strict=True):
                assert torch.equal(got, want)
    for i in range(len(results[0][0][2])):
        for c in (1, 2):
            assert rel(sum(r[c][2][i] for r in results), sum(r[0][2][i] for r in results)) < close
    for c in (1, 2):
        assert rel(torch.cat([r[c][0] for r in results], 1), ref.to(dtype)) < to_ref


@pytest.mark.parametrize("world,S,hq,hkv,chunks,mask_kind,packed,causal,window,softcap,use_sinks", CASES[-3:])
def test_overlapped_chunks_are_the_chunks_in_turn(monkeypatch, world, S, hq, hkv, chunks, mask_kind, packed,
                                                  causal, window, softcap, use_sinks):
    # Note [Overlapped chunks]: with ULYSSES_OVERLAP_CHUNKS=1 each recomputed chunk's kernel runs
    # on another thread while the next chunk's exchange (its mask and document ids too) runs on
    # the caller's; o and the gradients of q, k, v, the mask and the sinks are those of the
    # chunks in turn (0), bit for bit on the fused kernel, and match the reference.
    B, D = 2, 8
    gen = torch.Generator().manual_seed(world * 10 + S)
    Q, K, V = (torch.randn(B, S, h, D, generator=gen) for h in (hq, hkv, hkv))
    M = make_mask(mask_kind, B, hq, S, gen)
    sinks = torch.randn(hq, generator=gen) if use_sinks else None
    pos = positions_for(S) if packed else None
    lens = seq_lens(S, world)
    ref = reference_attention(Q.double(), K.double(), V.double(), None if M is None else
                              (M.double() if M.is_floating_point() else M), pos, causal=causal, window=window,
                              softcap=softcap, sinks=None if sinks is None else sinks.double())

    def body(rank, group):
        q, k, v = (shard(t, 1, rank, lens).clone().requires_grad_() for t in (Q, K, V))
        m = None if M is None else (M if M.shape[2] == 1 else shard(M, 2, rank, lens)).clone()
        m = m.requires_grad_() if m is not None and m.is_floating_point() else m
        s = None if sinks is None else sinks.clone().requires_grad_()
        attention = ulysses.DistributedAttention(group, causal=causal, window=window or None, softcap=softcap or None,
                                                 head_chunks=chunks, recompute_chunks=True, local="fused")
        o = attention(q, k, v, mask=m, position_ids=None if pos is None else shard(pos, 1, rank, lens), sinks=s)
        o.square().sum().backward()
        return [o.detach()] + [t.grad for t in (q, k, v, m, s) if t is not None and t.requires_grad]

    runs = {}
    for word in ("0", "1"):
        monkeypatch.setenv("ULYSSES_OVERLAP_CHUNKS", word)
        runs[word] = run_ranks(world, body)
    for in_turn, overlapped in zip(runs["0"], runs["1"], strict=True):
        assert len(overlapped) == len(in_turn) >= 4
        for got, want in zip(overlapped, in_turn, strict=True):
            assert torch.equal(got, want)
    assert rel(torch.cat([r[0] for r in runs["1"]], 1).double(), ref) < 1e-4


def chunks_seen(hq: int, hkv: int, counts: tuple, seed: int, recompute: bool = False) -> list:
    """On 2 ranks, one DistributedAttention per head_chunks value in ``counts`` with a callable
    local attention that records its (query heads, kv heads) per call (forward only). Per rank:
    {count: calls}, {count: o}, {count: repr}."""
    S, D = 10, 4
    gen = torch.Generator().manual_seed(seed)
    Q, K, V = (torch.randn(1, S, h, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    lens = seq_lens(S, 2)

    def body(rank, group):
        seen: dict = {c: [] for c in counts}
        outs, reprs = {}, {}
        for c in counts:
            def local(q, k, v, kv_map, mask, positions, causal, scale, c=c):
                seen[c].append((q.shape[1], k.shape[1]))
                return ulysses.local_attention(q, k, v, kv_map, causal=causal, kernel="math")
            attention = ulysses.DistributedAttention(group, causal=True, local=local, head_chunks=c,
                                                     recompute_chunks=recompute)
            outs[c] = attention(*(shard(t, 1, rank, lens) for t in (Q, K, V)))
            reprs[c] = repr(attention)
        return seen, outs, reprs

    return run_ranks(2, body)


def test_each_chunk_runs_the_local_attention_on_its_own_heads():
    # A callable local attention sees the chunks: 2 calls of 2 query heads and 1 kv head each
    # (P = 2, 8/4 heads), where the whole call hands it 4 and 2; the result is the same.
    for seen, outs, _ in chunks_seen(8, 4, (1, 2), seed=5):
        assert seen == {1: [(4, 2)], 2: [(2, 1), (2, 1)]}
        assert rel(outs[2], outs[1]) < 1e-14


@pytest.mark.parametrize("hkv,P,want", [(8, 2, 4), (8, 4, 2), (8, 8, 1), (2, 4, 1), (1, 2, 1), (32, 2, 4),
                                         (6, 4, 1), (12, 4, 3)])
def test_auto_takes_the_most_chunks_that_replicate_no_kv_head(hkv, P, want):
    # Up to 4; every chunk keeps at least P kv heads (replication costs more than chunking
    # saves: docs/long_sequences.md), and the chunks can be made for any GQA query count.
    assert _C.auto_head_chunks(hkv * 2, hkv, P) == want
    chunks = _C.head_chunks(hkv * 2, hkv, P, want)
    assert want == 1 or min(ke - kb for _, (kb, ke) in chunks) >= P


@pytest.mark.parametrize("hq,hkv,P,want", [(32, 8, 2, 8), (32, 8, 4, 8), (32, 8, 8, 4), (8, 8, 4, 2), (4, 1, 2, 1),
                                           (64, 64, 2, 8), (12, 6, 4, 3), (15, 15, 4, 3)])
def test_auto_recomputed_takes_the_most_chunks_the_heads_allow(hq, hkv, P, want):
    # Recomputed, replication saves nothing by heads and the step costs the recomputation,
    # nearly flat in the count: the most chunks that can be made, up to 8; one more cannot.
    assert _C.auto_head_chunks(hq, hkv, P, recompute=True) == want
    _C.head_chunks(hq, hkv, P, want)
    if want < min(8, hkv):
        with pytest.raises(ValueError, match="fewer than the"):
            _C.head_chunks(hq, hkv, P, want + 1)


def test_auto_chunks_as_its_count_does():
    # Llama-8B's 32/8 heads over 2 ranks: "auto" is 4 chunks, each a call of its own (the
    # callable sees them); the result is the whole call's.
    for seen, outs, reprs in chunks_seen(32, 8, (1, "auto"), seed=7):
        assert seen == {1: [(16, 4)], "auto": [(4, 1)] * 4}
        assert rel(outs["auto"], outs[1]) < 1e-14
        assert "head_chunks='auto'" in reprs["auto"]
    # Recomputed: as many chunks as the heads allow (8 kv heads: 8 calls of 2 query heads and
    # the chunk's one kv head, replicated on both ranks).
    for seen, outs, _ in chunks_seen(32, 8, (1, "auto"), seed=7, recompute=True):
        assert seen == {1: [(16, 4)], "auto": [(2, 1)] * 8}
        assert rel(outs["auto"], outs[1]) < 1e-14


def test_a_chunk_count_the_heads_cannot_make_fails_alike():
    S = 8
    Q, K = torch.randn(1, S, 4, 8), torch.randn(1, S, 2, 8)
    lens = seq_lens(S, 2)
    # Heads given: refused at construction.
    errors = run_ranks_errors(2, lambda rank, group: ulysses.DistributedAttention(
        group, q_heads=4, kv_heads=2, head_chunks=4))
    assert all("4 chunks of an attention with 2 kv heads" in e for e in errors)
    errors = run_ranks_errors(2, lambda rank, group: ulysses.DistributedAttention(group, head_chunks=0))
    assert all("head_chunks must be an int >= 1 or 'auto'; got 0" in e for e in errors)
    # Heads learned from the first call: every rank raises the same error, none hangs.
    errors = run_ranks_errors(2, lambda rank, group: ulysses.DistributedAttention(group, head_chunks=4)(
        shard(Q, 1, rank, lens), shard(K, 1, rank, lens), shard(K, 1, rank, lens)))
    assert len(set(errors)) == 1 and "4 chunks of an attention with 2 kv heads" in errors[0]


def test_on_the_fused_kernel_chunks_are_bit_identical():
    # float32 on the CPU's fused kernel: each head's arithmetic is the same in any chunk.
    S = 64
    gen = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(1, S, h, 16, generator=gen) for h in (8, 4, 4))
    lens = seq_lens(S, 2)

    def body(rank, group):
        runs = []
        for k in (1, 2, 4):
            q, k_, v = (shard(t, 1, rank, lens).clone().requires_grad_() for t in (Q, K, V))
            o = ulysses.DistributedAttention(group, causal=True, local="fused", head_chunks=k)(q, k_, v)
            o.square().sum().backward()
            runs.append((o.detach(), q.grad, k_.grad, v.grad))
        return runs

    for runs in run_ranks(2, body):
        for chunked in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(chunked, runs[0]))


def test_one_tensor_given_as_k_and_v_gets_both_gradients():
    # Chunks write each input's gradient into one buffer: k and v the same tensor add up there.
    S = 12
    gen = torch.Generator().manual_seed(9)
    Q, KV = torch.randn(1, S, 8, 8, generator=gen, dtype=torch.float64), torch.randn(1, S, 4, 8, generator=gen,
                                                                                      dtype=torch.float64)
    lens = seq_lens(S, 2)

    def body(rank, group):
        grads = []
        for k in (1, 2):
            q, kv = (shard(t, 1, rank, lens).clone().requires_grad_() for t in (Q, KV))
            ulysses.DistributedAttention(group, causal=True, head_chunks=k)(q, kv, kv).square().sum().backward()
            grads.append((q.grad, kv.grad))
        return grads

    for whole, chunked in run_ranks(2, body):
        assert rel(chunked[0], whole[0]) < 1e-13 and rel(chunked[1], whole[1]) < 1e-13


def test_a_chunk_count_given_on_one_rank_only_fails_alike():
    # Rank 0 chunks, rank 1 does not: rank 0's first chunk call meets rank 1's whole call in the
    # agreement, so both raise the same error (no rank waits in an exchange).
    S = 8
    Q, K = torch.randn(1, S, 4, 8), torch.randn(1, S, 2, 8)
    lens = seq_lens(S, 2)
    errors = run_ranks_errors(2, lambda rank, group: ulysses.DistributedAttention(
        group, head_chunks=2 if rank == 0 else 1)(*(shard(t, 1, rank, lens) for t in (Q, K, K))))
    assert len(set(errors)) == 1 and "ranks disagree on q_heads" in errors[0]


def test_recomputed_chunks_keep_nothing_by_heads_and_run_again_in_backward():
    # recompute_chunks (Note [Recomputed chunks]): forward saves no [B, H, S, D] tensor of the
    # whole sequence for backward, only each chunk's inputs; backward runs each chunk's local
    # attention again, with autograd, last chunk first. The gradients are the kept call's.
    S, D, hq, hkv = 10, 4, 8, 4
    gen = torch.Generator().manual_seed(11)
    Q, K, V = (torch.randn(1, S, h, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    lens = seq_lens(S, 2)

    def body(rank, group):
        results = {}
        for recompute in (False, True):
            calls: list = []

            def local(q, k, v, kv_map, mask, positions, causal, scale, calls=calls):
                calls.append((q.shape[1], torch.is_grad_enabled()))
                return ulysses.local_attention(q, k, v, kv_map, causal=causal, kernel="math")

            attention = ulysses.DistributedAttention(group, causal=True, local=local, head_chunks=2,
                                                     recompute_chunks=recompute)
            q, k, v = (shard(t, 1, rank, lens).clone().requires_grad_() for t in (Q, K, V))
            saved: list = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(tuple(t.shape)) or t,
                                                          lambda t: t):
                o = attention(q, k, v)
            o.square().sum().backward()
            by_heads = [s for s in saved if len(s) == 4 and s[2] == S]
            results[recompute] = calls, by_heads, [o.detach(), q.grad, k.grad, v.grad]
        return results

    for result in run_ranks(2, body):
        calls, by_heads, kept = result[False]
        assert calls == [(2, True), (2, True)] and by_heads
        calls, by_heads, recomputed = result[True]
        assert calls == [(2, False), (2, False), (2, True), (2, True)] and by_heads == []
        for got, want in zip(recomputed, kept, strict=True):
            assert rel(got, want) < 1e-14


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["BSHD", "SBHD", "BHSD"])
def test_recomputed_chunks_in_16_bits_are_the_kept_chunks_bit_for_bit(dtype, layout):
    # On the fused kernel a recomputed chunk's backward sends delta = rowsum(do * o) (fp32) to
    # heads with o's gradient in one exchange, as two 16-bit halves beside a 16-bit gradient: it
    # must arrive intact in every layout, as the kept chunks' gradients (sinks' included) show.
    S, hq, hkv, D = 12, 8, 4, 8
    gen = torch.Generator().manual_seed(5)
    shape = {"BSHD": lambda h: (2, S, h, D), "SBHD": lambda h: (S, 2, h, D), "BHSD": lambda h: (2, h, S, D)}[layout]
    seq_dim = layout.index("S")
    Q, K, V = (torch.randn(*shape(h), generator=gen).to(dtype) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen).to(dtype)
    lens = seq_lens(S, 2)

    def body(rank, group):
        results = []
        for recompute in (False, True):
            q, k, v = (shard(t, seq_dim, rank, lens).clone().requires_grad_() for t in (Q, K, V))
            s = sinks.clone().requires_grad_()
            o = ulysses.DistributedAttention(group, causal=True, layout=layout, head_chunks=2, local="fused",
                                             recompute_chunks=recompute)(q, k, v, sinks=s)
            o.float().square().sum().backward()
            results.append([o.detach(), q.grad, k.grad, v.grad, s.grad])
        return results

    for kept, recomputed in run_ranks(2, body):
        for got, want in zip(recomputed, kept, strict=True):
            assert got.dtype == dtype and torch.equal(got, want)


def test_a_recomputed_output_is_freed_only_where_nothing_else_holds_its_bytes():
    # _C.free_if_unshared (what a recomputed chunk does to its output before backward): a
    # tensor alone with its storage loses its bytes and keeps its shape; one whose storage a
    # view (as a kernel's saved copy of its output) shares is left whole.
    alone = torch.randn(3, 4)
    assert _C.free_if_unshared(alone) and alone.untyped_storage().nbytes() == 0 and alone.shape == (3, 4)
    shared = torch.randn(3, 4)
    view = shared.detach()
    assert not _C.free_if_unshared(shared) and torch.equal(shared, view)


def arm(group, rank, lens, Q, K):
    """A call with a StepContext: the group is armed after it (Note [Reused agreement]), so the
    next attention calls on it start in the armed exchange, not in an agreement round."""
    q, k = shard(Q, 1, rank, lens), shard(K, 1, rank, lens)
    return ulysses.DistributedAttention(group)(q * 1.0, k, k, step=ulysses.StepContext())


def math_local(q, k, v, kv_map, mask, positions, causal, scale):
    return ulysses.local_attention(q, k, v, kv_map, mask, positions, causal, scale, kernel="math")


@pytest.mark.parametrize("armed", [False, True])
@pytest.mark.parametrize("local", ["auto", math_local])
def test_recomputed_chunks_refuse_an_input_changed_in_place_on_one_rank_alike(armed, local):
    # Backward recomputes from the inputs: one changed in place since forward (here on rank 0
    # only) is refused on every rank alike, never recomputed into wrong gradients nor left to
    # the others' timeout, also where the group is armed by a later call (the others'
    # recomputation starts in the armed exchange). The library's kernel: C++ checks the
    # versions; a callable: Python's chunks, where autograd checks the chunk's slices.
    S = 8
    gen = torch.Generator().manual_seed(13)
    Q, K = torch.randn(1, S, 4, 8, generator=gen), torch.randn(1, S, 2, 8, generator=gen)
    lens = seq_lens(S, 2)

    def body(rank, group):
        leaf = shard(Q, 1, rank, lens).clone().requires_grad_()
        q, k = leaf * 1.0, shard(K, 1, rank, lens)
        o = ulysses.DistributedAttention(group, head_chunks=2, recompute_chunks=True, local=local)(q, k, k)
        if armed:
            o = o + arm(group, rank, lens, Q, K)
        if rank == 0:
            with torch.no_grad():
                q.add_(1.0)
        o.sum().backward()

    errors = run_ranks_errors(2, body)
    assert len(set(errors)) == 1, errors
    assert "(recompute_chunks): " in errors[0] and "[raised on rank 0 of 2]" in errors[0]
    assert re.search("modified (by an )?in ?place", errors[0]), errors[0]


def test_recomputed_chunks_refuse_an_output_changed_in_place_on_one_rank_alike():
    # On the fused kernel backward reads the chunks' heads of o: o changed in place since
    # forward (on rank 0 only) is refused on every rank alike, not turned into wrong gradients.
    S = 8
    gen = torch.Generator().manual_seed(14)
    Q, K = torch.randn(1, S, 4, 8, generator=gen), torch.randn(1, S, 2, 8, generator=gen)
    lens = seq_lens(S, 2)

    def body(rank, group):
        q, k = shard(Q, 1, rank, lens).requires_grad_(), shard(K, 1, rank, lens)
        o = ulysses.DistributedAttention(group, head_chunks=2, recompute_chunks=True)(q, k, k)
        if rank == 0:
            with torch.no_grad():
                o.mul_(2.0)
        o.sum().backward()

    errors = run_ranks_errors(2, body)
    assert len(set(errors)) == 1, errors
    assert "the attention's output was modified in place" in errors[0] and "[raised on rank 0 of 2]" in errors[0]


@pytest.mark.parametrize("local", ["auto", math_local])
def test_recomputed_chunks_backward_twice_with_a_retained_graph(local):
    # retain_graph keeps what each chunk's backward reads (its inputs, and on the fused kernel
    # its log-sum-exp and its heads of o): a second backward gives the same gradients.
    S = 8
    gen = torch.Generator().manual_seed(15)
    Q, K = torch.randn(1, S, 4, 8, generator=gen), torch.randn(1, S, 2, 8, generator=gen)
    lens = seq_lens(S, 2)

    def body(rank, group):
        q, k = shard(Q, 1, rank, lens).requires_grad_(), shard(K, 1, rank, lens)
        o = ulysses.DistributedAttention(group, head_chunks=2, recompute_chunks=True, local=local)(q, k, k)
        o.square().sum().backward(retain_graph=True)
        first, q.grad = q.grad, None
        o.square().sum().backward()
        return first, q.grad

    for first, second in run_ranks(2, body):
        assert first.abs().sum() > 0 and torch.equal(first, second)


def test_a_chunk_count_one_rank_cannot_make_fails_alike_on_an_armed_group():
    # Rank 0's count is refused before its first chunk; rank 1's first chunk call starts in the
    # group's armed exchange: rank 0 meets it there first, then both raise rank 0's error.
    S = 8
    Q, K = torch.randn(1, S, 4, 8), torch.randn(1, S, 2, 8)
    lens = seq_lens(S, 2)

    def body(rank, group):
        arm(group, rank, lens, Q, K)
        q, k = shard(Q, 1, rank, lens), shard(K, 1, rank, lens)
        ulysses.DistributedAttention(group, head_chunks=3 if rank == 0 else 2)(q, k, k)

    errors = run_ranks_errors(2, body)
    assert len(set(errors)) == 1 and "3 chunks of an attention with 2 kv heads" in errors[0]
