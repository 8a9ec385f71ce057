"""Trains a small Llama-architecture model (random init from a config; nothing downloaded) with
ulysses sequence parallelism, under torchrun:

    torchrun --nproc_per_node 2 examples/hf_sequence_parallel.py --seq-len 255 --steps 150

Every rank holds 1/P of each sequence (uneven lengths are fine); attention runs through
ulysses.DistributedAttention (registered with transformers as "ulysses"); the loss is the exact
global token mean. Prints loss, tokens/s and every rank's peak memory. The task: copy the first
half of each sequence into its second half, so the loss falls only if attention reaches across
shards (every rank draws the same batches and keeps its own tokens).
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import ulysses.hf as uhf


def copy_task(batch: int, seq_len: int, vocab: int, gen: torch.Generator) -> dict:
    half = seq_len // 2
    first = torch.randint(2, vocab, (batch, half), generator=gen)
    ids = torch.cat([first, torch.ones(batch, seq_len - 2 * half, dtype=torch.long), first], 1)
    labels = ids.clone()
    labels[:, : seq_len - half] = -100  # only the copied half is scored
    return {"input_ids": ids, "labels": labels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=255)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=16)
    a = p.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq_len,
                         attention_dropout=0.0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses")
    uhf.sequence_parallel(model, dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        lens = [a.seq_len // world + (r < a.seq_len % world) for r in range(world)]
        print(f"llama: {params} parameters, {a.heads} query / {a.kv_heads} kv heads, seq_len {a.seq_len} "
              f"over {world} ranks (tokens per rank: {lens})", flush=True)
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        shard = uhf.shard_batch(copy_task(a.batch, a.seq_len, a.vocab, gen), dist.group.WORLD)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                       ulysses_seq_lens=shard["seq_lens"]).logits
        loss, global_loss = uhf.sequence_parallel_loss(logits, shard["shift_labels"], dist.group.WORLD)
        optimizer.zero_grad()
        loss.backward()
        uhf.all_reduce_gradients(model, dist.group.WORLD)
        optimizer.step()
        if step == 1 or step % 25 == 0 or step == a.steps:
            seconds = time.perf_counter() - t0
            peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024])
            peaks = [torch.zeros_like(peak) for _ in range(world)]
            dist.all_gather(peaks, peak)
            if rank == 0:
                print(f"step {step}/{a.steps} loss {global_loss.item():.4f} "
                      f"tok/s {a.batch * a.seq_len * step / seconds:.0f} "
                      f"peak_rss_mb {'/'.join(str(int(x)) for x in peaks)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
