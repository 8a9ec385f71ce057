"""torch.ops.ulysses: schema, fake kernels and autograd registration (torch.library.opcheck),
and each op's values against slicing of full single-rank tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import run_processes, run_ranks, seq_lens, shard

ops = torch.ops.ulysses
TIMEOUT_MS = 30_000
OPTIONS = [TIMEOUT_MS]  # group_options: [timeout ms]


def collective_op_calls(rank: int, group: str, world: int) -> list:
    """One call of every collective op, with this rank's shapes (uneven S, GQA, float masks
    of both head kinds, requires_grad everywhere it can be)."""
    import ulysses

    lens = seq_lens(7, world)
    plan = ulysses.plan(4, 2, world)
    nq = plan["q_heads"][rank]
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(2, lens[rank], 4, 8, generator=g, requires_grad=True)
    k = torch.randn(2, lens[rank], 2, 8, generator=g, requires_grad=True)
    y = torch.randn(2, 7, nq, 8, generator=g, requires_grad=True)
    calls = [
        (ops.scatter_heads.default,
         ([q, k], ["q", "kv"], 4, 2, lens, "BSHD", group, OPTIONS, True, None, None, True)),
        (ops.gather_heads.default, ([y], ["q"], 4, 2, lens, "BSHD", group, OPTIONS)),
        # Head parts: q's and k's heads split by rank, flattened [tensor][rank].
        (ops.scatter_head_parts.default,
         ([q.detach()[:, :, a:b].clone().requires_grad_() for a, b in plan["q_ranges"]] +
          [k.detach()[:, :, a:b].clone().requires_grad_() for a, b in plan["kv_ranges"]],
          ["q", "kv"], 4, 2, lens, "BSHD", group, OPTIONS)),
        (ops.gather_head_parts.default, ([y], ["q"], 4, 2, lens, "BSHD", group, OPTIONS)),
        # Projections overlapped with the exchanges: q's without a bias, k's with one.
        (ops.scatter_projected.default,
         (torch.randn(2, lens[rank], 12, generator=g, requires_grad=True),
          [torch.randn(4 * 8, 12, generator=g, requires_grad=True),
           torch.randn(2 * 8, 12, generator=g, requires_grad=True)],
          [None, torch.randn(2 * 8, generator=g, requires_grad=True)], ["q", "kv"], 4, 2, lens,
          group, OPTIONS)),
        (ops.gather_projected.default,
         (y, torch.randn(12, 4 * 8, generator=g, requires_grad=True), 4, 2, lens, group, OPTIONS)),
        (ops.all_gather_sequence.default,
         (torch.randn(3, lens[rank], 2, requires_grad=True), 1, lens, group, OPTIONS)),
        (ops.reduce_scatter_sequence.default,
         (torch.randn(3, 7, 2, requires_grad=True), 1, lens, group, OPTIONS)),
    ]
    calls.append((ops.sum_over_group.default, (torch.randn(3, requires_grad=True), group, OPTIONS)))
    for heads in (1, 4):
        m = torch.randn(2, heads, lens[rank], 7, generator=g, requires_grad=True)
        calls.append((ops.rebuild_mask.default, (m, 4, 2, lens, group, OPTIONS)))
    calls.append((ops.rebuild_mask.default,  # a full (not sharded) per-head mask
                  (torch.randn(1, 4, 7, 7, requires_grad=True), 4, 2, lens, group, OPTIONS)))
    return calls


def _opcheck_collectives(rank: int, group: str, world: int) -> int:
    # Every rank runs the same sequence of checks, so the ops' collectives stay matched.
    calls = collective_op_calls(rank, group, world)
    for op, args in calls:
        torch.library.opcheck(op, args)
    return len(calls)


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck_collective_ops(tmp_path, world):
    """opcheck (schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes)
    of every collective op, on real Gloo groups of `world` processes."""
    assert run_processes(world, _opcheck_collectives, world, tmp_dir=str(tmp_path)) == [12] * world


def _shared_memory_exchange(rank: int, group: str, on_ranks: list[int]):
    """scatter_heads forward and backward with shared memory on (the default) on `on_ranks` and
    off (ULYSSES_SHARED_MEMORY=0) on the others: this rank's output and input gradient, or the
    error it raised."""
    import ulysses

    os.environ.pop("ULYSSES_SHARED_MEMORY", None)
    if rank not in on_ranks:
        os.environ["ULYSSES_SHARED_MEMORY"] = "0"
    S, H, D = 2048, 16, 64  # 4 MiB per rank (processes of one host: the flag handshake)
    lens = seq_lens(S, 2)
    q = shard(torch.randn(1, S, H, D, generator=torch.Generator().manual_seed(3)), 1, rank, lens)
    q = q.clone().requires_grad_()
    try:
        y = ulysses.scatter_heads([q], ["q"], H, H, lens, group=group)[0]
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + rank))
        (y * w).sum().backward()
    except ValueError as e:  # the agreement's error
        return str(e)
    with open("/proc/self/maps") as maps:  # outboxes stay mapped (unlinked) while the group lives
        mapped = "/ulysses-" in maps.read()
    return y.detach(), q.grad, mapped


def test_shared_memory_from_the_environment(tmp_path):
    """By default blocks between processes of one host go through /dev/shm:
    forward and backward match slicing of the full tensor bit for bit, and nothing is left in
    /dev/shm; ULYSSES_SHARED_MEMORY=0 turns it off; a rank whose environment differs fails alike
    with the others."""
    S, H, D = 2048, 16, 64
    Q = torch.randn(1, S, H, D, generator=torch.Generator().manual_seed(3))
    lens = seq_lens(S, 2)
    before = set(os.listdir("/dev/shm"))
    (tmp_path / "on").mkdir()
    (tmp_path / "one").mkdir()
    out = run_processes(2, _shared_memory_exchange, [0, 1], tmp_dir=str(tmp_path / "on"))
    assert set(os.listdir("/dev/shm")) == before
    W = [torch.randn(1, S, H // 2, D, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]
    dQ = torch.cat(W, dim=2)
    for rank, (y, dq, mapped) in enumerate(out):
        assert mapped, "shared memory is on by default, but no outbox was mapped"
        heads = slice(rank * H // 2, (rank + 1) * H // 2)
        assert torch.equal(y, Q[:, :, heads])
        assert torch.equal(dq, shard(dQ, 1, rank, lens))
    (tmp_path / "off").mkdir()
    off = run_processes(2, _shared_memory_exchange, [], tmp_dir=str(tmp_path / "off"))
    for rank, (y, dq, mapped) in enumerate(off):  # ULYSSES_SHARED_MEMORY=0: messages, the same bits
        assert not mapped and torch.equal(y, out[rank][0]) and torch.equal(dq, out[rank][1])
    errors = run_processes(2, _shared_memory_exchange, [1], tmp_dir=str(tmp_path / "one"))
    for e in errors:
        assert "ranks disagree on GroupOptions::shared_memory: rank 0 has no, rank 1 has yes" in e


@pytest.mark.parametrize("with_mask", [False, True])
def test_opcheck_flash_attention(with_mask):
    q = torch.randn(1, 4, 9, 8, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, requires_grad=True)
    v = torch.randn(1, 2, 9, 6, requires_grad=True)
    mask = torch.randn(1, 1, 9, 9, requires_grad=True) if with_mask else None
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1])
    torch.library.opcheck(ops.flash_attention.default, (q, k, v, [0, 0, 1, 1], mask, pos, True, 0.0, []))
    out, lse = ops.flash_attention(q, k, v, [0, 0, 1, 1], mask, pos, True, 0.0, [])
    g = torch.randn_like(out)
    delta = (g * out.detach()).sum(-1)  # What the kernel's backward reads of out.
    torch.library.opcheck(ops.flash_attention_backward.default,
                          (g, q.detach(), k.detach(), v.detach(), delta, lse.detach(),
                           [0, 0, 1, 1], None if mask is None else mask.detach(), pos, True, 0.0,
                           with_mask, []))


_ISA_CHECK = """
import torch, ulysses
from ulysses import _C, ops as U
torch.manual_seed(0)
S, kv = 200, [0, 0, 1, 1, 1]
pos = torch.cat([torch.arange(70), torch.arange(130)])
mask = torch.randn(1, 5, S, S, dtype=torch.float64)
ref = [t.requires_grad_() for t in (torch.randn(1, 5, S, 24, dtype=torch.float64),
       torch.randn(1, 2, S, 24, dtype=torch.float64), torch.randn(1, 2, S, 20, dtype=torch.float64))]
ours = [t.detach().float().requires_grad_() for t in ref]
g = torch.randn(1, 5, S, 20, dtype=torch.float64)
worst = 0.0
for causal, use_mask in [(False, True), (True, False)]:
    o_ref = U.local_attention(*ref, kv, mask=mask if use_mask else None, positions=pos, causal=causal,
                              kernel="math")
    o = U.flash_attention(*ours, kv, mask=mask.float() if use_mask else None, positions=pos,
                          causal=causal)
    grads_ref = torch.autograd.grad(o_ref, ref, g)
    grads = torch.autograd.grad(o, ours, g.float())
    for a, b in zip((o, *grads), (o_ref, *grads_ref)):
        worst = max(worst, ((a.double() - b).norm() / b.norm()).item())
print(_C.flash_attention_isa(), worst)
"""


@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_flash_kernel_in_each_instruction_set(isa):
    """The fused kernel is built once per instruction set and runs the one ATen picks (lowered
    by ATEN_CPU_CAPABILITY): each build this CPU can run matches the fp64 math kernel, forward
    and backward, with documents, a float mask and the causal rule."""
    order = ["DEFAULT", "AVX2", "AVX512"]
    supported = torch.backends.cpu.get_cpu_capability()  # What this CPU allows, unlowered.
    if supported not in order:
        pytest.skip(f"the kernel's instruction-set builds are x86's; this CPU runs {supported}")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa)
    proc = subprocess.run([sys.executable, "-c", _ISA_CHECK], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    ran, worst = proc.stdout.split()
    assert ran == order[min(order.index(isa.upper()), order.index(supported))]
    assert float(worst) < 1e-5


def test_opcheck_sequence_lengths():
    def body(rank, group):
        x = torch.randn(2, 3 + rank)
        torch.library.opcheck(ops.sequence_lengths.default, (x, 1, group, OPTIONS),
                              test_utils=("test_schema", "test_faketensor"))
        return ops.sequence_lengths(x, 1, group, OPTIONS).tolist()

    assert run_ranks(3, body) == [[3, 4, 5]] * 3


@pytest.mark.parametrize("world,hq,hkv", [(2, 4, 2), (3, 6, 3), (2, 15, 15), (4, 8, 2), (3, 4, 1)])
def test_scatter_heads_values_and_gradients(world, hq, hkv):
    """Each rank's scatter output equals the slice of the full tensor; gradients flow back
    through gather (kv replicas summed)."""
    import ulysses

    S, D = 11, 4
    lens = seq_lens(S, world)
    plan = ulysses.plan(hq, hkv, world)
    Q = torch.randn(2, S, hq, D, generator=torch.Generator().manual_seed(0))
    K = torch.randn(2, S, hkv, D, generator=torch.Generator().manual_seed(1))

    def body(rank, group):
        q = shard(Q, 1, rank, lens).clone().requires_grad_()
        k = shard(K, 1, rank, lens).clone().requires_grad_()
        qh, kh = ulysses.scatter_heads([q, k], ["q", "kv"], hq, hkv, lens, "BSHD", group)
        q0, q1 = plan["q_ranges"][rank]
        k0, k1 = plan["kv_ranges"][rank]
        assert torch.equal(qh, Q[:, :, q0:q1]) and torch.equal(kh, K[:, :, k0:k1])
        (qh.sum() * 2 + (kh * 3).sum()).backward()
        replicas = sum(1 for a, b in plan["kv_ranges"] for h in range(hkv) if a <= h < b)
        assert torch.equal(q.grad, torch.full_like(q, 2.0))
        # Each kv head's gradient is summed over the ranks holding a replica of it.
        counts = torch.tensor([sum(a <= h < b for a, b in plan["kv_ranges"]) for h in range(hkv)],
                              dtype=torch.float32)
        assert torch.equal(k.grad, (3.0 * counts).view(1, 1, hkv, 1).expand_as(k))
        return replicas

    run_ranks(world, body)


def test_ops_reject_unknown_group():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="no live process group is registered under the name 'nope'"):
        ops.sequence_lengths(x, 1, "nope", OPTIONS)
