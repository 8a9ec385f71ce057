"""What the GPU path relies on, tested where there is no GPU: a group made for another device
alone gets a CPU backend for the agreement, and the batched transport is chosen per backend."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ulysses
from conftest import run_processes, seq_lens, shard
from reference import reference_attention


def _device_only_backend(store, rank, size, timeout):
    """A backend registered for CUDA tensors alone (Gloo underneath): the group it makes has no
    CPU backend, as a group made with backend="nccl" has none."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _attend_on_a_device_only_group(rank: int, world_name: str):
    dist.Backend.register_backend("ulysses_device_only", _device_only_backend, devices=["cuda"])
    group = dist.new_group(backend="ulysses_device_only")
    before = [d.type for d in group._device_types]
    attn = ulysses.DistributedAttention(group, causal=True)  # adds the CPU backend
    after = sorted(d.type for d in group._device_types)
    S, lens = 10, seq_lens(10, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = attn(*(shard(t, 1, rank, lens) for t in (q, k, v)), seq_lens=lens)
    err = (out - shard(reference_attention(q, k, v, causal=True), 1, rank, lens)).abs().max().item()
    return before, after, err


def test_a_group_without_a_cpu_backend_gets_one_for_the_agreement(tmp_path):
    """An NCCL-only group would move each call's agreement through the GPU (a device-to-host
    copy per call). DistributedAttention gives such a group a Gloo backend for CPU tensors,
    through the group's own store; the call then runs, exact. Without it the CPU tensors of
    this test would have no backend at all."""
    for before, after, err in run_processes(2, _attend_on_a_device_only_group, tmp_dir=str(tmp_path)):
        assert before == ["cuda"] and after == ["cpu", "cuda"], (before, after)
        assert err < 1e-12, err
