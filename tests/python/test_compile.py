"""torch.compile(fullgraph=True) of a small GQA model built on ulysses.DistributedAttention:
same loss and gradients as eager, on real multi-process Gloo groups (P in 1, 2, 3; uneven S)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(__file__)


class TinyGQA(torch.nn.Module):
    """Embedding -> q/k/v projections -> sequence-parallel attention -> output projection."""

    def __init__(self, group, vocab=32, dim=32, hq=4, hkv=2, layers=2, head_chunks=1):
        super().__init__()
        import ulysses

        self.hq, self.hkv, self.hd = hq, hkv, dim // hq
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(dim, (hq + 2 * hkv) * self.hd) for _ in range(layers))
        self.attn = torch.nn.ModuleList(
            ulysses.DistributedAttention(group, q_heads=hq, kv_heads=hkv, causal=True, head_chunks=head_chunks)
            for _ in range(layers))
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, mask, seq_lens):
        x = self.embed(tokens)
        B, S, _ = x.shape
        for proj, attn in zip(self.qkv, self.attn):
            q, k, v = proj(x).split([self.hq * self.hd, self.hkv * self.hd, self.hkv * self.hd], -1)
            o = attn(q.view(B, S, self.hq, self.hd), k.view(B, S, self.hkv, self.hd),
                     v.view(B, S, self.hkv, self.hd), mask=mask, seq_lens=seq_lens)
            x = x + o.reshape(B, S, -1)
        return self.out(x)


def _worker(rank, world, store_path, S, result_path, head_chunks):
    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from conftest import seq_lens as even_lens
    from conftest import shard

    lens = even_lens(S, world)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    model = TinyGQA((mesh, "sp"), head_chunks=head_chunks)  # the SP group as a DeviceMesh dimension
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (2, S), generator=gen)
    targets = torch.randint(0, 32, (2, S), generator=gen)
    pad = torch.ones(2, 1, S, S, dtype=torch.bool)
    pad[1, :, :, S - 2:] = False
    t, y, m = shard(tokens, 1, rank, lens), shard(targets, 1, rank, lens), shard(pad, 2, rank, lens)

    def loss_and_grads(fn):
        model.zero_grad()
        logits = fn(t, m, lens)
        # Exact global token mean: the sum over this shard divided by all tokens.
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / y.numel() / 1.0
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total, [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    comp_loss, comp_grads = loss_and_grads(compiled)
    torch.save({"eager": (eager_loss, eager_grads), "compiled": (comp_loss, comp_grads)},
               f"{result_path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("world,S,head_chunks", [(1, 10, 1), (2, 13, 1), (3, 14, 1), (2, 13, 2)])
def test_compiled_matches_eager(tmp_path, world, S, head_chunks):
    result = str(tmp_path / "result")
    mp.start_processes(_worker, args=(world, str(tmp_path / "store"), S, result, head_chunks), nprocs=world,
                       start_method="spawn")
    for rank in range(world):
        r = torch.load(f"{result}.{rank}")
        (le, ge), (lc, gc) = r["eager"], r["compiled"]
        assert torch.allclose(le, lc, rtol=1e-6, atol=0), (le, lc)
        for a, b in zip(ge, gc):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
