"""local="flex": FlexAttention on each rank's heads, every rule as a block mask or score function
(ulysses.flex). Forward only here: torch has no CPU backward for FlexAttention (its eager path
computes the same function; the GPU check runs it compiled, with gradients). Each variant at
P = 1, 2 and 3 through DistributedAttention against the float64 math kernel on the same call,
in fp32 and bf16, uneven heads, GQA and MQA (kv replicated) included."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import ulysses
from conftest import run_ranks, run_ranks_errors, seq_lens, shard

B, S, D = 2, 13, 8
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # relative to the output's largest entry

# (name, constructor options, call inputs): every rule of the local attention.
VARIANTS = [
    ("plain", {}, ()),
    ("causal", {"causal": True}, ()),
    ("window", {"causal": True, "window": 4}, ()),
    ("softcap", {"causal": True, "softcap": 1.5}, ()),
    ("documents", {"causal": True}, ("positions",)),
    ("padding", {"causal": True}, ("padding",)),
    ("query_sharded_bias", {}, ("bias",)),
    ("sinks", {"causal": True}, ("sinks",)),
    ("everything", {"causal": True, "window": 5, "softcap": 2.0}, ("positions", "padding", "sinks")),
]
HEADS = [(6, 3), (7, 7), (4, 1)]  # GQA, uneven over 2 and 3 ranks, MQA (kv replicated)


def _inputs(hq: int, hkv: int):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    positions = torch.cat([torch.arange(5), torch.arange(8)]).expand(B, S)  # two documents a row
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, -3:] = False  # row 1 padded on the right
    padding = keep[:, None, None, :].expand(B, 1, S, S)  # [B, 1, S, S]: query rows sharded
    bias = torch.randn(B, hq, S, S, generator=gen, dtype=torch.float64)  # per head, query rows sharded
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64)  # one logit per query head, every rank
    return q, k, v, {"positions": positions, "padding": padding, "bias": bias, "sinks": sinks}


def _call(extras, given, rank, lens):
    """The call inputs ``given`` names, as rank ``rank`` holds them."""
    call = {}
    if "positions" in given:
        call["position_ids"] = shard(extras["positions"], 1, rank, lens)
    if "padding" in given:
        call["mask"] = shard(extras["padding"], 2, rank, lens)
    if "bias" in given:
        call["mask"] = shard(extras["bias"], 2, rank, lens)
    if "sinks" in given:
        call["sinks"] = extras["sinks"]
    return call


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("P", [1, 2, 3])
def test_flex_forward_matches_the_float64_kernel(P, hq, hkv):
    q, k, v, extras = _inputs(hq, hkv)
    lens = seq_lens(S, P)

    def body(rank, group):
        errors = {}
        for name, options, given in VARIANTS:
            call = _call(extras, given, rank, lens)
            x = [shard(t, 1, rank, lens) for t in (q, k, v)]
            want = ulysses.DistributedAttention(group, local="math", **options)(*x, **call)
            flex = ulysses.DistributedAttention(group, local="flex", **options)
            for dtype in (torch.float32, torch.bfloat16):
                c = {n: t.to(dtype) if t.is_floating_point() else t for n, t in call.items()}
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # flex's "called without torch.compile" off CUDA
                    got = flex(*(t.to(dtype) for t in x), **c)
                assert got.dtype == dtype
                errors[name, dtype] = ((got.double() - want).abs().max() / want.abs().max().clamp(min=1)).item()
        return errors

    for errors in run_ranks(P, body):
        for (name, dtype), error in errors.items():
            assert error <= TOLERANCE[dtype], f"{name} {dtype}: {error:.3g}"


def test_flex_refuses_training_off_cuda_alike_on_every_rank():
    lens = seq_lens(S, 2)

    def body(rank, group):
        q = torch.randn(1, lens[rank], 4, D, requires_grad=rank == 0)  # one rank's input only
        ulysses.DistributedAttention(group, local="flex", causal=True)(q, q, q)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and 'local="flex" runs forward only off CUDA' in errors[0]


def test_flex_sinks_given_on_one_rank_fail_alike():
    lens = seq_lens(S, 2)

    def body(rank, group):
        q = torch.randn(1, lens[rank], 4, D)
        sinks = torch.zeros(4) if rank == 1 else None  # one rank's argument only
        ulysses.DistributedAttention(group, local="flex")(q, q, q, sinks=sinks)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and "whether sinks is given" in errors[0], errors


@pytest.mark.parametrize("P", [1, 2, 3])
def test_auto_on_the_gpu_rule_takes_sdpa_when_plain_and_flex_otherwise(P, monkeypatch):
    """local="auto" on CUDA (the C++ rule, Note [Local attention by case]), its device forced on
    CPU: SDPA for a call with no rule but causal, FlexAttention for every other, run by Python;
    position ids count as documents until the gathered ones split none (then SDPA). Exact."""
    import ulysses.ops as ops

    hq, hkv = 6, 3
    q, k, v, extras = _inputs(hq, hkv)
    extras["default_positions"] = torch.arange(S).expand(B, S)  # one document a row: plain
    lens = seq_lens(S, P)
    chosen: list[tuple[str, str]] = []  # (case, kernel), every rank's calls of the rule
    choose = ops.local_kernel
    case = threading.local()  # each thread rank's current case

    def recorded(*args, **kwargs):
        kernel = choose(*args, **kwargs)
        if kernel != "math":  # not the reference's
            chosen.append((case.name, kernel))
        return kernel

    monkeypatch.setattr(ops, "_rule_device", lambda q: "cuda")
    monkeypatch.setattr(ops, "local_kernel", recorded)
    cases = VARIANTS + [("default_positions", {"causal": True}, ("default_positions",))]

    def body(rank, group):
        errors = {}
        for name, options, given in cases:
            call = _call(extras, given, rank, lens)
            if "default_positions" in given:
                call["position_ids"] = shard(extras["default_positions"], 1, rank, lens)
            x = [shard(t.float(), 1, rank, lens) for t in (q, k, v)]
            call = {n: t.float() if t.is_floating_point() else t for n, t in call.items()}
            want = ulysses.DistributedAttention(group, local="math", **options)(*x, **call)
            case.name = name
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flex's "called without torch.compile" off CUDA
                got = ulysses.DistributedAttention(group, **options)(*x, **call)
            errors[name] = ((got - want).abs().max() / want.abs().max()).item()
        return errors

    for errors in run_ranks(P, body):
        assert max(errors.values()) <= 1e-5, errors
    # Before the exchange (the call's facts), then after it where Python runs the kernel.
    want = {"plain": ["sdpa"], "causal": ["sdpa"], "default_positions": ["flex", "sdpa"]}
    for name, _, _ in cases:
        got = [kernel for n, kernel in chosen if n == name]
        assert sorted(got) == sorted(want.get(name, ["flex", "flex"]) * P), (name, got)


def test_a_models_layers_compile_a_bounded_number_of_times():
    """Compiled flex (CPU: inference) over the calls two Gemma-like models make: sliding and full
    layers (two rule mixes), two windows and two softcaps (tensors, not specialised numbers),
    four sequence lengths (the first two compile, then S is dynamic). Before, each window or
    softcap value compiled anew, and a second softcap failed to lower on CPU."""
    from torch._dynamo.utils import counters

    from ulysses import flex

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    graphs, calls = [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for S in (64, 80, 96, 112):
            for window, softcap in ((8, 2.0), (16, 3.0)):
                q = torch.randn(1, 4, S, 16, generator=gen)
                k, v = (torch.randn(1, 2, S, 16, generator=gen) for _ in range(2))
                for layer_window in (window, 0):  # a sliding layer, then a full one
                    call = dict(causal=True, window=layer_window, softcap=softcap)
                    calls.append((q, k, v, call, flex.attention(q, k, v, [0, 0, 1, 1], compiled=True, **call)))
            graphs.append(counters["stats"]["unique_graphs"])
        for q, k, v, call, got in calls:  # (eager flex may compile pieces of its own: after the count)
            want = flex.attention(q, k, v, [0, 0, 1, 1], compiled=False, **call)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), call
    # Two mixes x (flex, block mask) x (static, then dynamic S): 8 graphs for 16 calls, and none
    # after the second length.
    assert graphs[1] <= 8 and graphs[-1] == graphs[1], graphs


def test_a_steps_layers_share_one_block_mask():
    """With a StepContext a step's layers like each other build FlexAttention's block mask once."""
    from ulysses import flex

    q, k, v, extras = _inputs(4, 2)
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    step = ulysses.StepContext()
    before = flex.compile_stats["block_masks"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [flex.attention(q, k, v, [0, 0, 1, 1], positions=extras["positions"], causal=True, step=step)
                for _ in range(3)]
    assert flex.compile_stats["block_masks"] - before == 1
    assert all(torch.equal(o, outs[0]) for o in outs)
    flex.attention(q, k, v, [0, 0, 1, 1], positions=extras["positions"], causal=True, window=3, step=step)
    assert flex.compile_stats["block_masks"] - before == 2  # another rule: its own


@pytest.mark.parametrize("kv_map,group", [([0, 0, 1, 1], 2), ([0, 1], 1), ([0, 0, 0, 1], None), ([0, 1, 0, 1], None)])
def test_gqa_runs_as_flex_own_when_the_map_groups_evenly(kv_map, group):
    from ulysses import flex

    assert flex.gqa_group(kv_map, max(kv_map) + 1) == group
