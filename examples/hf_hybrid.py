"""A hybrid model (linear-time mixers among attention layers) under ulysses sequence parallelism:
a tiny Qwen3-Next from a config (gated delta-nets and one attention layer; nothing downloaded),
checked against itself unsharded in one call, then trained on a task that needs tokens from
other ranks' shards:

    torchrun --nproc_per_node 2 examples/hf_hybrid.py [--family qwen3_next|bamba|lfm2]

Each mixer runs the model's own kernels on the whole sequence of this rank's heads (B/C groups
and key heads as kv heads), or, for a short convolution, on its shard and the tokens before it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, BambaConfig, Lfm2Config, Qwen3NextConfig

import ulysses.hf as uhf
from hf_sequence_parallel import copy_task

COMMON = dict(vocab_size=16, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=512)
FAMILIES = {
    # 8 value heads over 2 key heads (each key head serves 4 value heads).
    "qwen3_next": lambda: Qwen3NextConfig(head_dim=16, linear_num_value_heads=8, linear_num_key_heads=2,
                                          linear_key_head_dim=16, linear_value_head_dim=8, mlp_only_layers=[0, 1],
                                          layer_types=["linear_attention", "full_attention"], **COMMON),
    # Mamba-2: 8 heads over 2 B/C groups.
    "bamba": lambda: BambaConfig(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
                                 mamba_d_state=16, mamba_expand=1, mamba_chunk_size=64, **COMMON),
    # LFM2: short convolutions of 3 tokens.
    "lfm2": lambda: Lfm2Config(layer_types=["conv", "full_attention"], conv_L_cache=3, **COMMON),
}


def slow_decays(model: torch.nn.Module) -> None:
    """Mixers' decays A in [0.02, 0.3] (initialised up to 16, their state forgets within a few
    tokens): the copy task then needs their memory, and no gate's gradient is ~1e-9, where
    Adam would turn rounding into whole steps (the Trainer tests compare parameters to 1e-5)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.02, 0.3).log())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=list(FAMILIES), default="qwen3_next")
    p.add_argument("--seq-len", type=int, default=127)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(0)  # the same model and batches on every rank
    model = AutoModelForCausalLM.from_config(FAMILIES[a.family]())
    slow_decays(model)
    uhf.sequence_parallel(model, group)
    gen = torch.Generator().manual_seed(1)
    print_ = print if rank == 0 else (lambda *args, **kwargs: None)
    print_(f"verify: {uhf.verify(model, copy_task(2, a.seq_len, 16, gen), group, tolerance=1e-5)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    for step in range(1, a.steps + 1):
        shard = uhf.shard_batch(copy_task(4, a.seq_len, 16, gen), group)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                       ulysses_seq_lens=shard["seq_lens"]).logits
        loss, global_loss = uhf.sequence_parallel_loss(logits, shard["shift_labels"], group)
        loss.backward()
        uhf.all_reduce_gradients(model, group)
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % (a.steps // 4 or 1) == 0:
            print_(f"{a.family} step {step}/{a.steps} loss {global_loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
