"""Shards the model as well as the sequence: FSDP2 (``fully_shard``) over every rank, attention
over sequence-parallel sub-groups of ``--sp`` ranks, under torchrun:

    torchrun --nproc_per_node 4 examples/hf_fsdp.py --sp 2 --seq-len 255 --steps 150

With 4 ranks and ``--sp 2`` that is DP 2 x SP 2: two replicas of the batch split, each sequence
split over two ranks, and every parameter, gradient and optimizer state sharded over all four
(SP ranks included). Two lines differ from a plain FSDP2 loop: ``ulysses.hf.sequence_parallel``
over the SP group, and the loss from ``sequence_parallel_loss(..., gradients="averaged")``, which
scales it for FSDP's gradient mean so that the update is the exact global token mean's (no
``all_reduce_gradients``: FSDP reduces the gradients). The task is examples/hf_sequence_parallel.py's.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

import ulysses.hf as uhf
from hf_sequence_parallel import copy_task  # this directory is on sys.path when run as a script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=2, help="ranks per sequence (must divide the world)")
    p.add_argument("--seq-len", type=int, default=255)
    p.add_argument("--batch", type=int, default=2, help="sequences per data-parallel replica")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=16)
    a = p.parse_args()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % a.sp:
        raise SystemExit(f"--sp {a.sp} must divide the world size {world}")
    sp_group, _ = dist.new_subgroups_by_enumeration([list(range(d, d + a.sp)) for d in range(0, world, a.sp)])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=a.seq_len,
                         attention_dropout=0.0)
    model = uhf.sequence_parallel(AutoModelForCausalLM.from_config(config, attn_implementation="ulysses"), sp_group)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=False)  # the root: backward needs it at once
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank; each replica keeps its rows
    replica = rank // a.sp
    if rank == 0:
        held = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        print(f"world {world} = dp {world // a.sp} x sp {a.sp}; {total} parameters, {held} held per rank",
              flush=True)
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        full = copy_task(a.batch * (world // a.sp), a.seq_len, a.vocab, gen)
        mine = {k: v[replica * a.batch:(replica + 1) * a.batch] for k, v in full.items()}
        shard = uhf.shard_batch(mine, sp_group)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                       ulysses_seq_lens=shard["seq_lens"]).logits
        loss, global_loss = uhf.sequence_parallel_loss(logits, shard["shift_labels"], dist.group.WORLD,
                                                       gradients="averaged")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step == 1 or step % 25 == 0 or step == a.steps):
            tokens = a.batch * (world // a.sp) * a.seq_len * step
            rate = tokens / (time.perf_counter() - t0)
            print(f"step {step}/{a.steps} loss {global_loss.item():.4f} tok/s {rate:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
