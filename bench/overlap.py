"""Recomputed head chunks with each chunk's kernel on another thread while the next chunk's
exchange crosses the link (Note [Overlapped chunks], include/ulysses/partition.h), against the
chunks in turn, side by side in one run: ``ULYSSES_OVERLAP_CHUNKS`` 1 and 0 in alternation, each
repeat timing both on the same ranks. One Llama-8B attention layer (32 query and 8 kv heads of
128, causal, float32) in ``--chunks`` recomputed chunks; ``fwd_s`` is the forward, ``step_s``
forward and backward (the backward's chunks run in turn either way), medians of ``--repeats``.

Run one rank per test host, across a shaped link (scripts/netns_hosts.sh, as root):

    scripts/netns_hosts.sh --hosts 2 --rate 1gbit --delay 200us -- sh -c 'exec .venv/bin/torchrun \\
        --nnodes 2 --node_rank $HOST_INDEX --nproc_per_node 1 --master_addr $MASTER_ADDR \\
        --master_port 29612 bench/overlap.py --seq-len 4096'

Ranks on one host hand over through shared memory, where nothing waits on a link: there auto
(the default) keeps the chunks in turn, and ``1`` shows what overlapping copies with the kernel
on the same cores costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import ulysses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hq, hkv, D = 32, 8, 128
    lens = ulysses._C.sequence_split(a.seq_len, world)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, lens[rank], h, D, generator=gen).requires_grad_() for h in (hq, hkv, hkv))
    grad = torch.randn(1, lens[rank], hq, D, generator=gen)
    attention = ulysses.DistributedAttention(dist.group.WORLD, q_heads=hq, kv_heads=hkv, causal=True,
                                             head_chunks=a.chunks, recompute_chunks=True)

    def step(word: str) -> tuple[float, float, torch.Tensor]:
        os.environ["ULYSSES_OVERLAP_CHUNKS"] = word
        q.grad = k.grad = v.grad = None
        dist.barrier()
        begun = time.perf_counter()
        o = attention(q, k, v, seq_lens=lens)
        forward = time.perf_counter() - begun
        o.backward(grad)
        dist.barrier()
        return forward, time.perf_counter() - begun, o.detach()

    step("0")  # Warm-up: links, buffers, the kernel's first touch.
    times: dict[str, list] = {"0": [], "1": []}
    outputs = {}
    for _ in range(a.repeats):
        for word in ("1", "0"):
            forward, whole, outputs[word] = step(word)
            times[word].append((forward, whole))
    same = torch.equal(outputs["0"], outputs["1"])
    if rank == 0:
        link = os.environ.get("LINK_RATE_BITS")
        print(f"S {a.seq_len}, P {world}, {a.chunks} recomputed chunks, link "
              f"{int(link) / 1e9:g} Gbit/s" if link else f"S {a.seq_len}, P {world}, {a.chunks} recomputed chunks",
              flush=True)
        print(f"{'overlap':>7} {'fwd_s':>7} {'step_s':>7}", flush=True)
        medians = {}
        for word in ("0", "1"):
            medians[word] = [statistics.median(t[i] for t in times[word]) for i in (0, 1)]
            print(f"{word:>7} {medians[word][0]:>7.3f} {medians[word][1]:>7.3f}", flush=True)
        print(f"fwd_over_in_turn {medians['1'][0] / medians['0'][0]:.3f} "
              f"step_over_in_turn {medians['1'][1] / medians['0'][1]:.3f} outputs_equal {same}", flush=True)
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
