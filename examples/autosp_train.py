"""Trains an ordinary single-device model (``PlainGQA`` below: no ulysses code in it) with
sequence parallelism made by ``ulysses.autosp``, under torchrun:

    torchrun --nproc_per_node 2 examples/autosp_train.py --seq-len 255 --steps 100

Every rank draws the same full batch and marks ``input_ids``; the compiled graph keeps this
rank's tokens, wraps each SDPA call in the all-to-alls and makes the loss the global token mean.
The task copies the first half of each sequence into its second half, so the loss falls only if
attention reaches across shards. ``--debug`` prints the graph before and after the rewrite.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class PlainGQA(nn.Module):
    """A decoder as people write it for one device: SDPA with ``enable_gqa``, RoPE tables from
    ``arange``, a causal padding mask built from ``attention_mask`` inside forward (or a 4-D
    ``mask`` given), a token-mean loss plus a small activation penalty (a plain ``.mean()``)."""

    def __init__(self, vocab=32, dim=32, hq=4, hkv=2, layers=2):
        super().__init__()
        self.vocab, self.hq, self.hkv, self.hd = vocab, hq, hkv, dim // hq
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, (hq + 2 * hkv) * self.hd) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(hq * self.hd, dim) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                               nn.Linear(2 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels, attention_mask=None, mask=None):
        b, s = input_ids.shape
        x = self.embed(input_ids)
        angle = torch.arange(s)[:, None].float() / 10000 ** (torch.arange(0, self.hd, 2) / self.hd)
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
        if mask is None and attention_mask is not None:
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            mask = attention_mask[:, None, None, :].bool() & causal
        half = self.hd // 2
        for qkv, out, mlp in zip(self.qkv, self.out, self.mlp):
            q, k, v = qkv(x).split([self.hq * self.hd, self.hkv * self.hd, self.hkv * self.hd], -1)
            q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
            q, k = (t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin for t in (q, k))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=True)
            x = x + out(o.transpose(1, 2).reshape(b, s, -1))
            x = x + mlp(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1))
        return loss + 1e-4 * x.pow(2).mean()


def copy_batch(batch: int, seq_len: int, vocab: int, gen: torch.Generator):
    half = seq_len // 2
    first = torch.randint(2, vocab, (batch, half), generator=gen)
    ids = torch.cat([first, torch.ones(batch, seq_len - 2 * half, dtype=torch.long), first], 1)
    labels = ids.roll(-1, 1)
    labels[:, : seq_len - half - 1] = -100  # only the copied half is scored
    labels[:, -1] = -100
    return ids, labels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=255)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--debug", action="store_true")
    args = p.parse_args()
    if args.debug:  # AutoSP logs the graphs on the "ulysses.autosp" logger.
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    dist.init_process_group("gloo")
    import ulysses

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = PlainGQA(vocab=16, dim=64, hq=8, hkv=2, layers=2)
    compiled = torch.compile(model, backend=ulysses.autosp(debug=args.debug and rank == 0), fullgraph=True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, labels = copy_batch(args.batch, args.seq_len, 16, gen)
        loss = compiled(ulysses.mark_sequence(ids), labels)
        loss.backward()
        ulysses.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    if rank == 0:
        print(f"autosp: {world} ranks, S={args.seq_len}, final loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
