"""GRPO (or RLOO, --rloo) with sequence parallelism: TRL's GRPOTrainer with ulysses'
WholeSequenceLogProbs mixin.
TRL generates the completions (transformers' generate on whole prompts, the policy unsharded);
every log-probability pass (the policy's, the reference model's for the KL term, the old
policy's) runs sequence-parallel. Launched with torchrun; without --sp (or one process) it is the
plain GRPOTrainer on the same data, for comparison:

    torchrun --nproc_per_node 2 examples/trl_grpo.py --sp 2       # SP 2
    python examples/trl_grpo.py                                   # the same run, one process
    torchrun --nproc_per_node 4 examples/trl_grpo.py --sp 2       # DP 2 x SP 2
    torchrun --nproc_per_node 2 examples/trl_grpo.py --sp 1       # the same run, plain DDP (DP 2)

A tiny Llama from a config, prompts of uneven lengths and a reward that counts one word, nothing
downloaded. --report writes the logged losses and the final parameters (rank 0), which the tests
compare with the plain run of the same data-parallel layout (the same completions: sampling
draws the same numbers on a DP rank with SP as without).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

import ulysses.hf  # noqa: F401  (registers attn_implementation="ulysses")
from hf_trainer import end_process_group, word_tokenizer
from ulysses.trainer import WholeSequenceLogProbs


class SequenceParallelGRPOTrainer(WholeSequenceLogProbs, GRPOTrainer):  # ulysses
    pass


class SequenceParallelRLOOTrainer(WholeSequenceLogProbs, RLOOTrainer):  # ulysses
    pass


def prompts(count: int, vocab: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)

    def words() -> str:
        n = int(torch.randint(3, 12, (), generator=gen))
        return " ".join(f"t{int(i)}" for i in torch.randint(2, vocab, (n,), generator=gen))

    return [{"prompt": words()} for _ in range(count)]


def count_t5(completions: list[str], **_: object) -> list[float]:
    """The reward: the share of the completion's words that are t5 (any learnable preference)."""
    return [sum(w == "t5" for w in c.split()) / max(1, len(c.split())) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel ranks per data-parallel group (1: plain)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step, over all DP groups")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--iterations", type=int, default=2, help="optimizer steps per generation (old-policy ratio)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2: the policy's parameters sharded over every rank")
    p.add_argument("--rloo", action="store_true", help="TRL's RLOOTrainer instead of GRPOTrainer")
    p.add_argument("--out", default="trl_grpo_out")
    p.add_argument("--report", default=None, help="write logged losses (json) and final parameters (.pt)")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sequence_parallel = world > 1 and a.sp > 1
    dp = world // a.sp if sequence_parallel else world
    torch.manual_seed(0)  # the same initial weights on every rank
    vocab = 32
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attention_dropout=0.0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses" if sequence_parallel else "eager")
    # With beta > 0, GRPOTrainer loads the reference model from the policy's path: give it one (one
    # folder per rank, so no two processes write the same files).
    initial = os.path.join(a.out, f"initial-rank{os.environ.get('RANK', '0')}")
    model.save_pretrained(initial)
    model.config._name_or_path = initial
    fsdp = dict(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    per_device = a.prompts * a.generations // dp
    # fp32 (GRPOConfig's default is bf16 autocast): exact against the plain run. beta > 0: the
    # reference model's log-probs (the KL term) run sequence-parallel too.
    config_class, plain, ours = (RLOOConfig, RLOOTrainer, SequenceParallelRLOOTrainer) if a.rloo else \
        (GRPOConfig, GRPOTrainer, SequenceParallelGRPOTrainer)
    args = config_class(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=per_device,
                      num_generations=a.generations, num_iterations=a.iterations, max_completion_length=10,
                      beta=0.04, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                      use_cpu=True, bf16=False, seed=0, save_strategy="no", ddp_find_unused_parameters=False,
                      **(fsdp if a.fsdp and sequence_parallel else {}))
    trainer_class = ours if sequence_parallel else plain
    extra = {"sp_size": a.sp} if sequence_parallel else {}
    trainer = trainer_class(model=model, reward_funcs=count_t5, args=args,
                            train_dataset=Dataset.from_list(prompts(a.steps * a.prompts, vocab, seed=1)),
                            processing_class=word_tokenizer(vocab), **extra)
    trainer.train()
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    params = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=a.fsdp, cpu_offload=a.fsdp))
    if trainer.args.process_index == 0:
        print(f"trl_grpo{' (RLOO)' if a.rloo else ''}: world {world} (dp {dp} x sp {a.sp if sequence_parallel else 1}"
              f"{', FSDP2' if a.fsdp else ''}), step 1 loss {losses[1]:.6f} reward {rewards[0]:.4f}, "
              f"step {max(losses)} loss {losses[max(losses)]:.6f} reward {rewards[-1]:.4f}", flush=True)
        if a.report:
            with open(a.report + ".json", "w") as f:
                json.dump({"losses": losses, "rewards": rewards, "logs": trainer.state.log_history}, f)
            torch.save({k: v.detach().clone() for k, v in params.items()}, a.report + ".pt")
    end_process_group()


if __name__ == "__main__":
    main()
