"""Trains a small Llama (random init from a config; nothing downloaded) with transformers' Trainer
and ulysses sequence parallelism, no DeepSpeed:

    torchrun --nproc_per_node 4 examples/hf_trainer.py --sp 2      # DP 2 x SP 2
    torchrun --nproc_per_node 2 examples/hf_trainer.py --sp 2 --packed
    torchrun --nproc_per_node 4 examples/hf_trainer.py --sp 2 --fsdp   # parameters sharded too
    torchrun --nproc_per_node 2 examples/hf_trainer.py --sp 2 --model qwen3_next   # a hybrid
    torchrun --nproc_per_node 2 examples/hf_trainer.py --sp 2 --model qwen2_5_vl   # an image per row
    torchrun --nproc_per_node 4 examples/hf_trainer.py --sp 2 --model gemma3       # (or Gemma 3)
    torchrun --nproc_per_node 2 examples/hf_trainer.py --sp 2 --model llava --trl  # TRL's VLM collator
    python examples/hf_trainer.py --sp 1                           # the plain Trainer, one process

The lines that make it sequence parallel are marked "ulysses". The task: copy the first half of
each sequence into its second half (lengths vary, so batches are padded, or packed with
--packed), so the loss falls only if attention reaches across each rank's shard. With --trl the
same runs under TRL's SFTTrainer with packing. With --fsdp the parameters, gradients and optimizer
state are sharded over every rank with FSDP2, by the TrainingArguments a GPU script passes.
--report writes the logged losses and the final parameters (rank 0), which the tests compare with
the single-process run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BambaConfig,
    DataCollatorWithFlattening,
    Gemma3Config,
    LlamaConfig,
    LlavaConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen3NextConfig,
    Trainer,
    TrainingArguments,
)

import ulysses.hf  # noqa: F401  (registers attn_implementation="ulysses")
from hf_hybrid import slow_decays
from ulysses.trainer import SequenceParallel, SequenceParallelTrainer


def copy_task(count: int, max_len: int, vocab: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        half = int(torch.randint(max_len // 4, max_len // 2 + 1, (), generator=gen))
        first = torch.randint(2, vocab, (half,), generator=gen)
        ids = torch.cat([first, torch.ones(1, dtype=torch.long), first]).tolist()
        labels = [-100] * (half + 1) + first.tolist()  # only the copied half is scored
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def word_tokenizer(vocab: int, special: dict[str, int] | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer for token ids as words ("t0".."t31"), and `special` tokens (found inside words,
    as a processor writes "<image><image>"), built here: TRL wants one, and nothing is downloaded."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    special = special or {}
    words = Tokenizer(WordLevel({**{f"t{i}": i for i in range(vocab)}, **special}, unk_token="t1"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", unk_token="t1", eos_token="t1",
                                   extra_special_tokens=list(special))


def llava_processor(vocab: int):
    """LLaVA's processor for the tiny model's 28 x 28 images (4 image tokens: CLIP's 2 x 2 patches,
    its class token dropped), built here, as TRL's VLM collator calls a model's processor."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=images, tokenizer=word_tokenizer(vocab, {"<image>": IMAGE}), patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def with_image_files(rows: list[dict], seed: int) -> list[dict]:
    """TRL's VLM rows: an image (28 x 28 pixels, as a dataset holds it) and the text after it."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    return [{"images": [Image.fromarray(torch.randint(0, 256, (28, 28, 3), generator=gen, dtype=torch.uint8).numpy())],
             "text": "<image> " + " ".join(f"t{i}" for i in r["input_ids"])} for r in rows]


# The tiny models: Llama, and two hybrids whose mixers ulysses.hybrid runs under SP (gated
# delta-nets; Mamba-2 layers with fewer B/C groups than heads), each with one attention layer.
MODELS = {
    "llama": lambda vocab, positions: LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=positions, attention_dropout=0.0, pad_token_id=0),
    "qwen3_next": lambda vocab, positions: Qwen3NextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
        mlp_only_layers=[0, 1], max_position_embeddings=positions, pad_token_id=0),
    "bamba": lambda vocab, positions: BambaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_expand=1, mamba_chunk_size=32, max_position_embeddings=positions, pad_token_id=0),
}


# A vision-language model: Qwen2.5-VL's tower (a window block and a full one) and mrope, its
# image tokens after the task's vocabulary.
IMAGE, VISION_START, VIDEO = 32, 33, 34
PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch: one row of pixel_values
MODELS["qwen2_5_vl"] = lambda vocab, positions: Qwen2_5_VLConfig(
    text_config=dict(vocab_size=vocab + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions, pad_token_id=0,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 10000.0}),
    vision_config=dict(depth=2, num_heads=2, hidden_size=16, intermediate_size=32, out_hidden_size=64,
                       fullatt_block_indexes=[1], window_size=56),
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START)


# Gemma 3: a SigLIP tower of 28 x 28 images (4 tokens each, seen both ways: token_type_ids), a
# sliding layer (window 8) and a full one.
MODELS["gemma3"] = lambda vocab, positions: Gemma3Config(
    text_config=dict(vocab_size=vocab + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=positions,
                     pad_token_id=0, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    vision_config=dict(image_size=28, patch_size=14, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2),
    mm_tokens_per_image=4, image_token_id=IMAGE)
# LLaVA: a CLIP tower of 28 x 28 images, under TRL's SFTTrainer with its VLM collator (--trl).
MODELS["llava"] = lambda vocab, positions: LlavaConfig(
    text_config=dict(model_type="llama", vocab_size=vocab + 1, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=positions, pad_token_id=0),
    vision_config=dict(model_type="clip_vision_model", image_size=28, patch_size=14, hidden_size=16,
                       intermediate_size=32, num_hidden_layers=2, num_attention_heads=2),
    image_token_index=IMAGE)
VISION_LANGUAGE = ("qwen2_5_vl", "gemma3", "llava")


def model_config(name: str, vocab: int, positions: int):
    return MODELS[name](vocab, positions)


def with_images(rows: list[dict], seed: int, model: str) -> list[dict]:
    """Each row after an image: its 4 image tokens (unscored; Qwen2.5-VL's after a vision start)
    first, and the image's pixels (Qwen2.5-VL's: its 16 patches)."""
    gen = torch.Generator().manual_seed(seed)
    if model == "gemma3":
        return [{"input_ids": [IMAGE] * 4 + r["input_ids"], "labels": [-100] * 4 + r["labels"],
                 "pixel_values": torch.randn(1, 3, 28, 28, generator=gen)} for r in rows]
    return [{"input_ids": [VISION_START] + [IMAGE] * 4 + r["input_ids"], "labels": [-100] * 5 + r["labels"],
             "pixel_values": torch.randn(16, PATCH, generator=gen)} for r in rows]


def layer_class(model: torch.nn.Module) -> str:
    """The class name of the model's decoder layers (what FSDP wraps)."""
    layers = model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers
    return type(layers[0]).__name__


def pad_right(rows: list[dict]) -> dict:
    longest = max(len(r["input_ids"]) for r in rows)

    def padded(key: str, fill: int) -> torch.Tensor:
        return torch.tensor([r[key] + [fill] * (longest - len(r[key])) for r in rows])

    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (longest - len(r["input_ids"])) for r in rows])
    batch = {"input_ids": padded("input_ids", 0), "labels": padded("labels", -100), "attention_mask": mask}
    if "pixel_values" in rows[0]:  # a VLM's batch: the rows' images
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows])
        if batch["pixel_values"].dim() == 4:  # Gemma 3's: its image blocks
            batch["token_type_ids"] = (batch["input_ids"] == IMAGE).long()
        else:  # Qwen2.5-VL's: one grid each
            batch.update(image_grid_thw=torch.tensor([[1, 4, 4]] * len(rows)),
                         mm_token_type_ids=(batch["input_ids"] == IMAGE).long())
    return batch


def pack_with_images(rows: list[dict], rope_index=None) -> dict:
    """A VLM's rows packed into one, as DataCollatorWithFlattening packs text: positions restart
    at each document and its first label is unscored; the images in order. Qwen2.5-VL's position
    ids are [4, 1, S]: the text positions, then each document's own mrope positions (its model's
    get_rope_index on the document alone)."""
    ids = [torch.tensor(r["input_ids"]) for r in rows]
    batch = {"input_ids": torch.cat(ids)[None], "labels": torch.cat([torch.tensor([-100] + r["labels"][1:])
                                                                     for r in rows])[None],
             "pixel_values": torch.cat([r["pixel_values"] for r in rows])}
    text = torch.cat([torch.arange(len(i)) for i in ids])[None]
    if rope_index is None:  # Gemma 3
        batch.update(position_ids=text, token_type_ids=(batch["input_ids"] == IMAGE).long())
        return batch
    grid = torch.tensor([[1, 4, 4]])
    mrope = [rope_index(input_ids=i[None], mm_token_type_ids=(i[None] == IMAGE).long(), image_grid_thw=grid)[0]
             for i in ids]
    batch.update(position_ids=torch.cat([text[None], torch.cat(mrope, dim=2)]),
                 image_grid_thw=grid.repeat(len(rows), 1), mm_token_type_ids=(batch["input_ids"] == IMAGE).long())
    return batch


def end_process_group() -> None:
    """Ends the default group after a Trainer's run, while the interpreter is whole: torn down at
    exit instead, a Gloo worker thread can abort the process ("terminate called without an active
    exception")."""
    if not dist.is_initialized():
        return
    dist.barrier()
    # The barrier's work is released on a Gloo thread that needs the GIL: let it go before the
    # group's teardown joins that thread while holding the GIL (a deadlock seen once).
    time.sleep(0.5)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel ranks per data-parallel group")
    p.add_argument("--packed", action="store_true", help="pack each batch into one row (position ids restart)")
    p.add_argument("--trl", action="store_true", help="TRL's SFTTrainer with packing instead of Trainer")
    p.add_argument("--model", choices=list(MODELS), default="llama",
                   help="the tiny model: Llama, a hybrid (gated delta-nets, Mamba-2 layers) among attention, "
                        "or a vision-language model (an image per row; llava under TRL only)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, over all ranks")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-len", type=int, default=96)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (default: fp32, exact against one process)")
    p.add_argument("--eval", action="store_true", help="evaluate on held-out sequences at the end")
    p.add_argument("--long", action="store_true",
                   help="long-sequence memory: tiled MLP, tiled logits + loss, layers checkpointed with offload")
    p.add_argument("--fsdp", action="store_true", help="FSDP2: parameters sharded over every rank (SP ranks too)")
    p.add_argument("--verify", type=float, default=None,
                   help="check the first step against the model unsharded; stop above this relative error")
    p.add_argument("--out", default="hf_trainer_out")
    p.add_argument("--report", default=None, help="write logged losses (json) and final parameters (.pt)")
    a = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dp = world // a.sp
    per_device = a.global_batch // (dp * a.grad_accum)
    if per_device * dp * a.grad_accum != a.global_batch:
        raise SystemExit(f"--global-batch {a.global_batch} must divide by dp {dp} x --grad-accum {a.grad_accum}")

    torch.manual_seed(0)  # the same initial weights on every rank
    vocab = 32
    config = model_config(a.model, vocab, 4 * a.max_len)
    sequence_parallel = world > 1
    vlm = a.model in VISION_LANGUAGE
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="ulysses" if sequence_parallel else "eager")
    slow_decays(model)
    train = copy_task(a.steps * a.global_batch, a.max_len, vocab, seed=1)
    held_out = copy_task(2 * a.global_batch + 3, a.max_len, vocab, seed=2)  # uneven last batch
    if vlm and (a.trl != (a.model == "llava") or (a.trl and a.packed)):
        raise SystemExit("--model llava runs under TRL (--trl, no --packed), the other VLMs under the plain Trainer")
    if a.model == "llava":
        train, held_out = with_image_files(train, 3), with_image_files(held_out, 4)
    elif vlm:
        train, held_out = with_images(train, 3, a.model), with_images(held_out, 4, a.model)
    common = dict(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=per_device,
                  per_device_eval_batch_size=per_device, gradient_accumulation_steps=a.grad_accum,
                  learning_rate=a.lr, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                  save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
                  use_cpu=True, bf16=a.bf16, seed=0, ddp_find_unused_parameters=False, dataloader_drop_last=False,
                  include_num_input_tokens_seen="non_padding")  # logged: each SP group's tokens once
    if a.fsdp and sequence_parallel:  # as on GPUs; on CPU the mixin applies FSDP2 from these arguments
        common.update(fsdp=True,
                      fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer_class(model)]})
    collator = DataCollatorWithFlattening() if a.packed else pad_right
    if vlm and a.packed:
        rope_index = model.model.get_rope_index if a.model == "qwen2_5_vl" else None
        collator = functools.partial(pack_with_images, rope_index=rope_index)
    # Small tiles, so that the tiny model runs several of each.
    long = dict(tiled_mlp=True, tiled_loss=True, checkpoint="offload", mlp_tile_tokens=16) if a.long else {}
    if a.trl:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        class SequenceParallelSFTTrainer(SequenceParallel, SFTTrainer):  # ulysses
            pass

        if vlm:  # TRL's VLM collator: the processor tokenizes and makes pixels per batch, padded rows
            args = SFTConfig(**common, max_length=None, remove_unused_columns=False)  # (keeps "text")
            processor = llava_processor(vocab)
        else:
            args = SFTConfig(**common, packing=True, max_length=2 * a.max_len)  # packed rows of whole sequences
            processor = word_tokenizer(vocab)
        trainer_class = SequenceParallelSFTTrainer if sequence_parallel else SFTTrainer
        extra = {"sp_size": a.sp, "verify_tolerance": a.verify, **long} if sequence_parallel else {}
        trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(train),
                                eval_dataset=Dataset.from_list(held_out), processing_class=processor, **extra)
    else:
        args = TrainingArguments(**common)  # Defaults: remove_unused_columns=True reads the forward's signature.
        if sequence_parallel:
            trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                                              data_collator=collator, sp_size=a.sp, verify_tolerance=a.verify,
                                              **long)  # ulysses
        else:
            trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                              data_collator=collator)
    trainer.train(resume_from_checkpoint=a.resume)
    metrics = trainer.evaluate() if a.eval else {}
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    # Whole parameters (gathered from every rank's shard under FSDP2: a collective, on every rank).
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    params = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=a.fsdp, cpu_offload=a.fsdp))
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trainer.model.parameters())
    held_share = held / sum(p.numel() for p in trainer.model.parameters())  # of the parameters, on this rank
    if trainer.args.process_index == 0:
        first, last = min(losses), max(losses)
        kind = ("TRL SFTTrainer, its VLM collator" if a.trl and vlm else "TRL SFTTrainer, packed" if a.trl
                else "packed" if a.packed else "padded")
        evaluated = f", eval loss {metrics['eval_loss']:.4f}" if a.eval else ""
        kind += " batches" + (f", FSDP2 ({held_share:.0%} of the parameters per rank)" if a.fsdp else "")
        print(f"hf_trainer: world {world} (dp {dp} x sp {a.sp if sequence_parallel else 1}), {kind}, "
              f"step {first} loss {losses[first]:.4f}, step {last} loss {losses[last]:.4f}{evaluated}", flush=True)
        verification = getattr(trainer, "verification", None)
        if verification is not None:
            print(f"hf_trainer: step 1 verified against the model unsharded: {verification}", flush=True)
        if a.report:
            with open(a.report + ".json", "w") as f:
                json.dump({"losses": losses, "eval_loss": metrics.get("eval_loss"),
                           "total_train_batch_size": trainer.get_total_train_batch_size(trainer.args),
                           "held_share": held_share, "wrapped": type(trainer.model_wrapped).__name__,
                           "verified": None if verification is None else verification.worst,
                           "logs": trainer.state.log_history}, f)
            torch.save({k: v.detach().clone() for k, v in params.items()}, a.report + ".pt")
    end_process_group()


if __name__ == "__main__":
    main()
