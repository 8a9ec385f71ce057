"""Smoke check of an installed wheel, run on 2 ranks (torchrun or `ulysses launch`): GQA
attention with a padding mask through ulysses.DistributedAttention equals single-rank attention
on the full sequence, forward and backward. Exits non-zero otherwise."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ulysses

dist.init_process_group("gloo")
rank, P = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
B, S, HQ, HKV, D = 2, 11, 6, 2, 8
gen = torch.Generator().manual_seed(0)
q, k, v, w = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))
keep = torch.ones(B, S, dtype=torch.bool)
keep[0, :3] = False  # left padding on row 0
lens = [S // P + (r < S % P) for r in range(P)]
lo = sum(lens[:rank])
rows = slice(lo, lo + lens[rank])

# Reference: one rank, the whole sequence (BHSD), kv heads repeated for GQA.
ref = [t.clone().requires_grad_() for t in (q, k, v)]
qr, kr, vr = (t.transpose(1, 2) for t in ref)
kr, vr = (t.repeat_interleave(HQ // HKV, dim=1) for t in (kr, vr))
mask = keep[:, None, None, :] & torch.ones(S, S, dtype=torch.bool).tril()
out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask).transpose(1, 2)
(out * w).sum().backward()

mine = [t[:, rows].clone().requires_grad_() for t in (q, k, v)]
attention = ulysses.DistributedAttention(dist.group.WORLD, q_heads=HQ, kv_heads=HKV, causal=True)
o = attention(*mine, mask=keep[:, None, None, :].expand(B, 1, lens[rank], S))
(o * w[:, rows]).sum().backward()


def err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


errors = {"out": err(o, out[:, rows])}
for name, got, want in zip("qkv", mine, ref):
    errors["d" + name] = err(got.grad, want.grad[:, rows])
print(f"rank {rank}: relative errors vs single-rank attention " +
      ", ".join(f"{n} {e:.1e}" for n, e in errors.items()), flush=True)
assert max(errors.values()) < 1e-10, errors
dist.destroy_process_group()
