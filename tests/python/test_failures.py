"""Invalid setups where ONE rank's call differs: every rank raises the same clear error, before
any payload moves, and never aborts or hangs (the groups' timeout is 5 s: a hang would surface
as a timeout error, not the expected message)."""

from __future__ import annotations

import pytest
import torch

import ulysses
from conftest import run_ranks_errors, seq_lens

S_R, B, H, D = 4, 1, 4, 8  # Each rank holds 4 tokens: S = 8 over 2 ranks.


def qkv(**over):
    shape = over.pop("shape", (B, S_R, H, D))
    dtype = over.pop("dtype", torch.float32)
    q = torch.randn(*shape).to(dtype)
    return q, q.clone(), q.clone()


def bool_mask():
    return torch.ones(B, 1, S_R, 2 * S_R, dtype=torch.bool)


def positions(n=S_R, dims=2):
    p = torch.arange(n)
    return p.unsqueeze(0) if dims == 2 else p


def call(rank, group, *, bad, attn=None, q=None, mask=None, pos=None, seq_lens=None, step=None,
         layout="BSHD", causal=False):
    """Runs one DistributedAttention call; `bad` picks what rank 1 does differently."""
    attn = attn or ulysses.DistributedAttention(group, layout=layout if rank == 0 else bad.get("layout", layout),
                                                causal=causal if rank == 0 else bad.get("causal", causal),
                                                timeout=5)
    args = dict(mask=mask, pos=pos, seq_lens=seq_lens, step=step)
    if rank == 1:
        args.update({k: v for k, v in bad.items() if k in args})
        q = bad.get("q", q)
    q, k, v = q if q is not None else qkv()
    if rank == 1 and "k" in bad:
        k = bad["k"]
    attn(q, k, v, mask=args["mask"], position_ids=args["pos"], seq_lens=args["seq_lens"],
         step=args["step"])


CATALOGUE = {
    # name: (rank 1's difference, kwargs for both ranks, expected message)
    "mask bool vs float": (dict(mask=torch.zeros(B, 1, S_R, 2 * S_R)), dict(mask=bool_mask()),
                           "ranks disagree on the mask's dtype"),
    "mask requires grad on one rank": (dict(mask=torch.zeros(B, 1, S_R, 2 * S_R, requires_grad=True)),
                                       dict(mask=torch.zeros(B, 1, S_R, 2 * S_R)),
                                       "ranks disagree on whether the mask requires grad"),
    "mask on one rank only": (dict(mask=bool_mask()), {}, "ranks disagree on whether the mask is given: "
        "rank 0 has no, rank 1 has yes"),
    "mask 2-D vs 4-D": (dict(mask=torch.ones(S_R, 2 * S_R, dtype=torch.bool)), dict(mask=bool_mask()),
                        "ranks disagree on the mask's number of dims"),
    "mask key-sharded on one rank": (dict(mask=torch.ones(B, 1, S_R, S_R, dtype=torch.bool)),
                                     dict(mask=bool_mask()), "ranks disagree on mask's shape"),
    "mask 5-D": (dict(mask=torch.ones(1, B, 1, S_R, 2 * S_R, dtype=torch.bool)), dict(mask=bool_mask()),
                 "agree_plan: mask must be 2-D [Sq, Sk], 3-D [heads, Sq, Sk] or 4-D [B, heads, Sq, Sk]; "
                 "got [1, 1, 1, 4, 8]"),
    "positions on one rank only": (dict(pos=positions()), {}, "ranks disagree on whether position_ids is given"),
    "positions wrong length": (dict(pos=positions(S_R + 1)), dict(pos=positions()),
                               "position_ids must be [B, S_r] = [1, 4] or [S_r] (this shard's positions); got [1, 5]"),
    "positions int32 vs int64": (dict(pos=positions().int()), dict(pos=positions()),
                                 "ranks disagree on position_ids's dtype: rank 0 has Long, rank 1 has Int"),
    "StepContext on one rank only": (dict(step=ulysses.StepContext()), {},
                                     "ranks disagree on whether a StepContext is used"),
    "causal on one rank only": (dict(causal=True), {}, "ranks disagree on causal"),
    "layout SBHD vs BSHD (same shapes)": (dict(layout="SBHD", q=qkv(shape=(S_R, B, H, D))), {},
                                          "ranks disagree on the layout: rank 0 has BSHD, rank 1 has SBHD"),
    "seq_lens differ": (dict(seq_lens=[3, 5]), dict(seq_lens=[4, 4]),
                        "ranks disagree on the given sequence split"),
    "q 5-D": (dict(q=qkv(shape=(B, S_R, H, D, 1))), {}, "agree_plan: q must be a 4-D tensor in layout BSHD; "
        "got [1, 4, 4, 8, 1] [raised on rank 1 of 2]"),
    "heads 4 vs 2": (dict(q=qkv(shape=(B, S_R, 2, D))), {}, "ranks disagree on q_heads: rank 0 has 4, rank 1 has 2"),
    "q heads not a multiple of kv heads": (dict(k=torch.randn(B, S_R, 3, D)), {},
                                           "query heads (4) must be a multiple of kv heads (3)"),
    "batch 1 vs 2": (dict(q=qkv(shape=(2, S_R, H, D))), {}, "ranks disagree on q's dim 0: rank 0 has 1, rank 1 has 2"),
    "head dim 8 vs 16": (dict(q=qkv(shape=(B, S_R, H, 16))), {}, "ranks disagree on q's dim 3: rank 0 has "
        "8, rank 1 has 16"),
    "fp32 vs fp64": (dict(q=qkv(dtype=torch.float64)), {}, "ranks disagree on q's dtype: rank 0 has Float, "
        "rank 1 has Double"),
    "int64 inputs": (dict(q=qkv(dtype=torch.int64)), {}, "must be floating point"),
    "k another dtype than q": (dict(k=torch.randn(B, S_R, H, D, dtype=torch.float64)), {},
                               "k is Double but q is Float; give them one dtype [raised on rank 1 of 2]"),
    "k on another device": (dict(k=torch.randn(B, S_R, H, D, device="meta")), {},
                            "k is on meta but q is on cpu; move them to one device [raised on rank 1 of 2]"),
    "tokens of q and k differ": (dict(k=torch.randn(B, S_R + 1, H, D)), {}, "has 5 tokens but"),
    "q requires grad on one rank only": (dict(q=tuple(t.requires_grad_() for t in qkv())), {},
                                         "ranks disagree on whether q, "
                                             "k, v require grad: rank 0 has no, rank 1 has yes"),
    "mask fp64 vs fp32": (dict(mask=torch.zeros(B, 1, S_R, 2 * S_R, dtype=torch.float64)),
                          dict(mask=torch.zeros(B, 1, S_R, 2 * S_R)), "ranks disagree on the mask's dtype"),
    "mask int8 vs bool": (dict(mask=torch.ones(B, 1, S_R, 2 * S_R, dtype=torch.int8)), dict(mask=bool_mask()),
                          "mask must be bool (true = attend) or an additive float mask; got Char"),
    "mask batch 2 vs 1": (dict(mask=torch.ones(2, 1, S_R, 2 * S_R, dtype=torch.bool)), dict(mask=bool_mask()),
                          "mask has shape [2, 1, 4, 8]: its batch dim must be 1 or B = 1"),
    "mask per head vs shared": (dict(mask=torch.ones(B, H, S_R, 2 * S_R, dtype=torch.bool)),
                                dict(mask=bool_mask()), "ranks disagree on mask's shape"),
    "mask on another device": (dict(mask=torch.ones(B, 1, S_R, 2 * S_R, dtype=torch.bool, device="meta")),
                               dict(mask=bool_mask()), "agree_plan: mask is on meta but q is on "
                                   "cpu; move it to cpu [raised on rank 1 of 2]"),
    "positions float vs int64": (dict(pos=positions().float()), dict(pos=positions()),
                                 "position_ids must be integers; got Float"),
    "positions on another device": (dict(pos=positions().to("meta")), dict(pos=positions()),
                                    "agree_plan: position_ids is on meta but q is on cpu; move it to cpu "
                                    "[raised on rank 1 of 2]"),
    "positions batch 2 vs 1": (dict(pos=positions().expand(2, S_R)), dict(pos=positions()),
                               "position_ids must be [B, S_r] = [1, 4] or [S_r] (this shard's positions); got [2, 4]"),
    "seq_lens given on one rank only": (dict(seq_lens=[4, 4]), {},
                                        "ranks disagree on the given "
                                            "sequence split (seq_lens): rank 0 has none (learned), rank 1 has given"),
    "seq_lens [4, 5] vs [4, 4]": (dict(seq_lens=[4, 5]), dict(seq_lens=[4, 4]),
                                  "ranks disagree on the given sequence split"),
    "v with other kv heads than k": (dict(k=torch.randn(B, S_R, 2, D)), {}, "must have 2 kv heads"),
}


def run_case(case: str) -> list[str]:
    bad, both, _ = CATALOGUE[case]
    return run_ranks_errors(2, lambda rank, group: call(rank, group, bad=bad, **both), timeout_s=5)


@pytest.mark.parametrize("case", list(CATALOGUE))
def test_one_rank_differs_every_rank_fails_alike(case):
    message = CATALOGUE[case][2]
    errors = run_case(case)
    assert errors[0] != "" and errors[0] == errors[1], errors
    assert message in errors[0], errors[0]
    assert "timed out" not in errors[0] and "Timeout" not in errors[0]


@pytest.mark.parametrize("shape,message", [
    ((0, S_R, H, D), "every dim but the sequence dim 1 must be >= 1"),
    ((B, S_R, H, 0), "every dim but the sequence dim 1 must be >= 1"),
])
def test_degenerate_sizes_are_errors(shape, message):
    errors = run_ranks_errors(2, lambda rank, group: call(rank, group, bad={}, q=qkv(shape=shape)),
                              timeout_s=5)
    assert errors[0] == errors[1] and message in errors[0], errors


def test_nan_propagates_through_the_fused_kernel():
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    k, v = torch.randn(1, 1, 6, 8, requires_grad=True), torch.randn(1, 1, 6, 8, requires_grad=True)
    with torch.no_grad():
        q[0, 0, 2, 3] = float("nan")
    out = ulysses.flash_attention(q, k, v, [0, 0])
    assert out[0, 0, 2].isnan().all() and not out[0, 1].isnan().any()
    out.sum().backward()
    assert q.grad[0, 0, 2].isnan().any() and k.grad.isnan().any()  # as the math reference


if __name__ == "__main__":  # Prints the catalogue as a table: case, error (every rank), seconds.
    import time

    print("| case (rank 1 differs) | error raised on both ranks | seconds |\n|---|---|---|")
    for case in CATALOGUE:
        t0 = time.perf_counter()
        errors = run_case(case)
        alike = "" if errors[0] == errors[1] else " (RANKS DIFFER)"
        print(f"| {case} | {errors[0].splitlines()[0]}{alike} | {time.perf_counter() - t0:.2f} |")


@pytest.mark.parametrize("which", ["qkv", "q", "k", "v"])
def test_a_tensor_on_another_device_type_on_one_rank_fails_alike(which):
    """One rank's q, k and/or v on the meta device (the other rank's on CPU): the autocast cast
    that runs before the agreement must not raise there alone; the agreement names the device."""

    def body(rank, group):
        attn = ulysses.DistributedAttention(group, q_heads=H, kv_heads=H, timeout=5)
        tensors = dict(zip("qkv", qkv()))
        if rank == 0:
            for name in which:
                tensors[name] = torch.empty_like(tensors[name], device="meta")
        attn(tensors["q"], tensors["k"], tensors["v"])

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1], errors
    if which == "qkv":  # Every rank's tensors on one device: the ranks' devices differ.
        assert "ranks disagree on q's device type: rank 0 has meta, rank 1 has cpu" in errors[0], errors
    else:  # Rank 0's own tensors differ: its local check's error, raised on every rank.
        other = "q" if which != "q" else "k"
        assert "meta" in errors[0] and f"{other} is on" in errors[0] and "[raised on rank 0 of 2]" in errors[0], errors


@pytest.mark.parametrize("armed", [False, True])
def test_sinks_given_to_a_callable_on_one_rank_fail_alike(armed):
    # Armed: a call with a StepContext came first, so rank 1's call starts in the group's armed
    # exchange (Note [Reused agreement]), where rank 0's refusal must meet it first.
    def local(q, k, v, kv_map, mask, positions, causal, scale):
        return torch.ops.ulysses.local_attention(q, k, v, kv_map, mask, positions, causal, scale)

    def body(rank, group):
        if armed:
            ulysses.DistributedAttention(group)(*qkv(), step=ulysses.StepContext())
        attn = ulysses.DistributedAttention(group, q_heads=H, kv_heads=H, local=local, timeout=5)
        attn(*qkv(), sinks=torch.zeros(H) if rank == 0 else None)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and "a callable local attention takes no sinks" in errors[0], errors


@pytest.mark.parametrize("what", ["mask", "position_ids"])
def test_a_mask_or_positions_on_another_device_than_q_fail_alike(what):
    """One rank's mask (or position ids) on another device than its q: a CPU mask beside CUDA q
    would reach NCCL, which has no CPU tensors. Simulated with the meta device: the agreement
    refuses it before any collective, on every rank, naming the device to use."""

    def body(rank, group):
        attn = ulysses.DistributedAttention(group, q_heads=H, kv_heads=H, causal=True, timeout=5)
        extra = {"mask": bool_mask()} if what == "mask" else {"position_ids": positions()}
        if rank == 1:
            extra = {k: v.to("meta") for k, v in extra.items()}
        attn(*qkv(), **extra)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1], errors
    assert f"agree_plan: {what} is on meta but q is on cpu; move it to cpu [raised on rank 1 of 2]" in errors[0]


def test_the_cpu_only_kernel_on_another_device_fails_alike_in_the_agreement():
    """local="fused" (the CPU kernel) with one rank's q, k, v elsewhere (meta standing in for
    CUDA): refused in the agreement, before the exchange, alike on every rank."""

    def body(rank, group):
        attn = ulysses.DistributedAttention(group, q_heads=H, kv_heads=H, local="fused", timeout=5)
        tensors = qkv()
        if rank == 0:
            tensors = tuple(t.to("meta") for t in tensors)
        attn(*tensors)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1], errors
    assert ('local attention "fused" runs on CPU tensors; q is on meta: use local="auto" (SDPA) there '
            "[raised on rank 0 of 2]") in errors[0], errors


def test_math_scores_above_their_bound_off_the_cpu_are_refused_alike():
    """Note [No silent S x S]: off the CPU (the meta device stands in for a GPU; the refusal comes
    in the agreement, before any data moves) a softcap would send attention to the math kernel,
    whose fp32 scores at S = 32768 take 16 GiB per rank: every rank raises the same error, naming
    local="flex". local="flex" itself is not bound (it moves on to the exchange, which fails on
    meta tensors for another reason)."""
    S = 32768
    lens = seq_lens(S, 2)

    def body(rank, group, local="auto"):
        q = torch.empty(1, lens[rank], 8, 64, device="meta")
        ulysses.DistributedAttention(group, causal=True, softcap=30.0, local=local)(q, q, q)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] != ""
    assert "would run the math kernel (SDPA has no softcap)" in errors[0] and 'use local="flex"' in errors[0]
    flex = run_ranks_errors(2, lambda rank, group: body(rank, group, "flex"))
    assert all("math kernel" not in e for e in flex), flex


@pytest.mark.parametrize("op", ["all_gather_sequence", "reduce_scatter_sequence"])
def test_a_sequence_split_given_otherwise_on_one_rank_fails_alike(op):
    """Each rank gives the split (seq_lens); one that differs used to reach Gloo with other sizes
    (an abort). The agreement round compares the splits first."""

    def body(rank, group):
        lens = [3, 2] if rank == 0 else [2, 3]
        tokens = lens[rank] if op == "all_gather_sequence" else sum(lens)
        getattr(ulysses.ops, op)(torch.ones(1, tokens), 1, lens, group)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and f"{op}: ranks disagree on the tensor's sequence split" in errors[0], errors
