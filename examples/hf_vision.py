"""A vision-language model under ulysses sequence parallelism: a tiny Qwen2.5-VL from a config
(nothing downloaded), with one image and one short video in every row, checked against itself
unsharded in one call, then trained a few steps:

    torchrun --nproc_per_node 2 examples/hf_vision.py

Every rank runs the model on the whole batch (its images too): the vision tower encodes them
with its own attention, their embeddings are merged and the mrope positions made on the whole
sequence, and the language model runs on this rank's shard, its attention through ulysses.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

import ulysses.hf as uhf

IMAGE, VIDEO, VISION_START, VOCAB = 60, 61, 62, 64
PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch (Qwen2.5-VL's vision input)


def config() -> Qwen2_5_VLConfig:
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                        "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1], window_size=56)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                            vision_start_token_id=VISION_START)


def batch(rows: int, seq_len: int, gen: torch.Generator) -> dict:
    """Rows of text with one image (a 4 x 4 patch grid: 4 tokens) and one video (2 x 4 x 4: 8
    tokens), each after a vision-start token; the labels are the tokens."""
    ids = torch.randint(0, IMAGE - 1, (rows, seq_len), generator=gen)
    at_image, at_video = seq_len // 4, seq_len // 2
    ids[:, at_image - 1] = ids[:, at_video - 1] = VISION_START
    ids[:, at_image:at_image + 4] = IMAGE
    ids[:, at_video:at_video + 8] = VIDEO
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(rows * 16, PATCH, generator=gen),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * rows),
            "pixel_values_videos": torch.randn(rows * 32, PATCH, generator=gen),
            "video_grid_thw": torch.tensor([[2, 4, 4]] * rows),
            "mm_token_type_ids": (ids == IMAGE).long() + 2 * (ids == VIDEO).long()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=61)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(0)  # the same model and batches on every rank
    model = uhf.sequence_parallel(AutoModelForImageTextToText.from_config(config()), group)
    gen = torch.Generator().manual_seed(1)
    print_ = print if rank == 0 else (lambda *args, **kwargs: None)
    print_(f"verify: {uhf.verify(model, batch(2, a.seq_len, gen), group, tolerance=1e-5)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, a.steps + 1):
        whole = batch(2, a.seq_len, gen)
        shard = uhf.shard_batch({k: whole[k] for k in ("input_ids", "labels", "attention_mask")}, group)
        inputs = {k: v for k, v in whole.items() if k != "labels"}
        logits = model(**inputs, ulysses_seq_lens=shard["seq_lens"]).logits  # this rank's shard of the logits
        loss, global_loss = uhf.sequence_parallel_loss(logits, shard["shift_labels"], group)
        loss.backward()
        uhf.all_reduce_gradients(model, group)
        optimizer.step()
        optimizer.zero_grad()
        print_(f"step {step}/{a.steps} loss {global_loss.item():.4f} (tokens per rank {shard['seq_lens']})",
               flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
