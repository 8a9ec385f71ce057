"""DPO with sequence parallelism: TRL's DPOTrainer with ulysses' WholeSequenceLogProbs mixin, the
policy and the reference model both sequence-parallel, launched with torchrun (one process: the
plain DPOTrainer on the same data, for comparison):

    torchrun --nproc_per_node 2 examples/trl_dpo.py --sp 2
    torchrun --nproc_per_node 4 examples/trl_dpo.py --sp 2 --fsdp   # DP 2 x SP 2, parameters sharded
    python examples/trl_dpo.py                                      # one process, plain DPOTrainer

A tiny Llama from a config and a synthetic preference set (prompts, chosen and rejected
completions of uneven lengths, padded), nothing downloaded. --report writes the logged losses and
the final parameters (rank 0), which the tests compare with the one-process run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
from datasets import Dataset
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import DPOConfig, DPOTrainer

import ulysses.hf  # noqa: F401  (registers attn_implementation="ulysses")
from hf_trainer import end_process_group, word_tokenizer
from ulysses.trainer import WholeSequenceLogProbs


class SequenceParallelDPOTrainer(WholeSequenceLogProbs, DPOTrainer):  # ulysses
    pass


def preference_rows(count: int, vocab: int, seed: int) -> list[dict]:
    """Prompts of 6-14 words, chosen and rejected completions of 4-12: every pair a different shape."""
    gen = torch.Generator().manual_seed(seed)

    def words(lo: int, hi: int) -> str:
        n = int(torch.randint(lo, hi + 1, (), generator=gen))
        return " ".join(f"t{int(i)}" for i in torch.randint(2, vocab, (n,), generator=gen))

    return [{"prompt": words(6, 14), "chosen": words(4, 12), "rejected": words(4, 12)} for _ in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel ranks per data-parallel group")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=4, help="preference pairs per optimizer step")
    p.add_argument("--fsdp", action="store_true", help="FSDP2: the policy's parameters sharded over every rank")
    p.add_argument("--eval", action="store_true", help="evaluate on held-out pairs at the end")
    p.add_argument("--out", default="trl_dpo_out")
    p.add_argument("--report", default=None, help="write logged losses (json) and final parameters (.pt)")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sequence_parallel = world > 1
    dp = world // a.sp if sequence_parallel else 1
    torch.manual_seed(0)  # the same initial weights on every rank
    vocab = 32
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attention_dropout=0.0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses" if sequence_parallel else "eager")
    # fp32 (DPOConfig's default is bf16 autocast): exact against the one-process run.
    fsdp = dict(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    args = DPOConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.global_batch // dp,
                     per_device_eval_batch_size=a.global_batch // dp, learning_rate=1e-3, lr_scheduler_type="constant",
                     logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no",
                     ddp_find_unused_parameters=False, **(fsdp if a.fsdp and sequence_parallel else {}))
    trainer_class = SequenceParallelDPOTrainer if sequence_parallel else DPOTrainer
    extra = {"sp_size": a.sp} if sequence_parallel else {}
    trainer = trainer_class(model=model, ref_model=copy.deepcopy(model), args=args,
                            train_dataset=Dataset.from_list(preference_rows(a.steps * a.global_batch, vocab, seed=1)),
                            eval_dataset=Dataset.from_list(preference_rows(2 * a.global_batch, vocab, seed=2)),
                            processing_class=word_tokenizer(vocab), **extra)
    trainer.train()
    metrics = trainer.evaluate() if a.eval else {}
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    # Whole parameters (gathered from every rank's shard under FSDP2: a collective, on every rank).
    params = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=a.fsdp, cpu_offload=a.fsdp))
    if trainer.args.process_index == 0:
        evaluated = f", eval loss {metrics['eval_loss']:.4f}" if a.eval else ""
        print(f"trl_dpo: world {world} (dp {dp} x sp {a.sp if sequence_parallel else 1}{', FSDP2' if a.fsdp else ''})"
              f", step 1 loss {losses[1]:.4f}, step {max(losses)} loss {losses[max(losses)]:.4f}{evaluated}",
              flush=True)
        if a.report:
            with open(a.report + ".json", "w") as f:
                json.dump({"losses": losses, "eval_loss": metrics.get("eval_loss"),
                       "logs": trainer.state.log_history}, f)
            torch.save({k: v.detach().clone() for k, v in params.items()}, a.report + ".pt")
    end_process_group()


if __name__ == "__main__":
    main()
