"""ulysses.hf.verify: one call checks a sequence-parallel model against itself unsharded, on a
batch of yours. Every rank runs one forward and backward on its shard and the same model on the
whole batch, and gets the worst relative error of the loss and of each parameter's gradient.

    torchrun --nproc_per_node 2 examples/hf_verify.py [--break-one]

--break-one sums every gradient over the group but one, the mistake this check exists for: the
check names that parameter.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import ulysses
import ulysses.hf as uhf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--break-one", action="store_true", help="leave one gradient out of the reduction")
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same model and batch on every rank
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, attention_dropout=0.0)
    model = uhf.sequence_parallel(AutoModelForCausalLM.from_config(config), dist.group.WORLD)
    ids = torch.randint(0, 64, (2, 37))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # row 1 padded on the right
    broken = None
    if a.break_one:
        names = [n for n, q in model.named_parameters() if q.requires_grad]

        def broken(grads, group):
            summed = [g for n, g in zip(names, grads) if n != "model.layers.1.mlp.up_proj.weight"]
            torch.ops.ulysses.all_reduce_gradients(summed, group, ulysses.groups.group_options(None))

    result = uhf.verify(model, {"input_ids": ids, "attention_mask": mask}, dist.group.WORLD,
                        reduce_gradients=broken)
    if dist.get_rank() == 0:
        print(f"verify: {result}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
