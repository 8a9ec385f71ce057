"""The vision tower of a vision-language model under sequence parallelism: each frame encoded
once per SP group (``ulysses.vision``: frames split over the ranks, one all-gather of their
embeddings) against every rank encoding everything, side by side in one run.

    python bench/vision.py [--sp 2,4] [--frames 32] [--size 224] [--tower qwen2_5_vl|siglip]

A Qwen2.5-VL vision tower (4 blocks of width 256, window and full attention) encodes one video of
``--frames`` frames of ``--size`` pixels square (``--tower siglip``: a SigLIP tower of the same
width and depth, as Gemma 3's and LLaVA-OneVision's, encodes ``--frames`` images, each on its
own), forward and backward, on every rank of a Gloo group on loopback (fresh processes, one
intra-op thread each). Per rank: the CPU seconds of this rank's thread in the tower
(``time.thread_time``: the ranks share this machine's cores, so wall time would measure the
sharing) and the resident-set high-water mark above the rank's set before (``peak_MiB``); each
the slowest / largest rank's. ``ratio`` is once / replicated; the target is
at most 1.2 / P.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from memory import _reset_peak, _status_kib, spawn_ranks  # noqa: E402  (one copy of the helpers)


def _tower(kind: str, size: int):
    if kind == "siglip":
        from transformers import SiglipVisionConfig, SiglipVisionModel

        torch.manual_seed(0)
        return SiglipVisionModel(SiglipVisionConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                                    num_attention_heads=4, image_size=size, patch_size=14)).float()
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4,
                                                 out_hidden_size=256, fullatt_block_indexes=[3], window_size=112),
                              text_config=dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2))
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config).float()


def _rank(rank: int, world: int, port: int, task: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    import ulysses.hf  # noqa: F401  (the group plumbing)
    from ulysses import vision

    tower = _tower(task["tower"], task["size"])
    object.__setattr__(tower, "_ulysses_group", ulysses.groups.group_name(dist.group.WORLD))
    gen = torch.Generator().manual_seed(1)
    if task["tower"] == "siglip":  # images, each encoded on its own
        object.__setattr__(tower, "_ulysses_share_images", True)
        object.__setattr__(tower, "_ulysses_feature_layers", [-1])
        pixels = torch.randn(task["frames"], 3, task["size"], task["size"], generator=gen)
        whole, once, field = type(tower).forward, vision._images_encoded_once, "last_hidden_state"
    else:
        side = task["size"] // 14  # patches per side
        grid = torch.tensor([[task["frames"] // 2, side, side]])  # temporal patches of 2 frames
        pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=gen)
        whole = functools.partial(type(tower).forward, grid_thw=grid)
        once = functools.partial(vision._encoded_once, grid_thw=grid, ulysses_seq_lens=[1] * world)
        field = "pooler_output"

    def encode() -> float:
        start = time.thread_time()
        out = (once if task["design"] == "once" else whole)(tower, pixels)
        getattr(out, field).square().sum().backward()
        tower.zero_grad(set_to_none=True)
        return time.thread_time() - start

    encode()  # warm-up
    dist.barrier()
    baseline = _status_kib("VmRSS")
    _reset_peak()
    seconds = encode()
    peak = _status_kib("VmHWM")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"cpu_s": seconds, "peak_mib": (peak - baseline) / 1024}, f)
    dist.destroy_process_group()


def measure(task: dict) -> dict:
    ranks = spawn_ranks(_rank, task)
    return {**task, "cpu_s": max(r["cpu_s"] for r in ranks), "peak_mib": max(r["peak_mib"] for r in ranks)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", default="2,4")
    p.add_argument("--frames", type=int, default=32, help="video frames (two per temporal patch)")
    p.add_argument("--size", type=int, default=224, help="frame side in pixels (a multiple of 28)")
    p.add_argument("--tower", default="qwen2_5_vl", choices=("qwen2_5_vl", "siglip"),
                   help="siglip: --frames images, each encoded on its own")
    a = p.parse_args()
    print(f"{'P':>2} {'frames':>6} {'design':<10} {'vision_cpu_s':>12} {'peak_MiB':>9} {'ratio':>6} {'1.2/P':>6}",
          flush=True)
    for sp in map(int, a.sp.split(",")):
        rows = {design: measure(dict(sp=sp, frames=a.frames, size=a.size, tower=a.tower, design=design))
                for design in ("replicated", "once")}
        for design, row in rows.items():
            ratio = row["cpu_s"] / rows["replicated"]["cpu_s"]
            print(f"{sp:>2} {a.frames:>6} {design:<10} {row['cpu_s']:>12.2f} {row['peak_mib']:>9.1f} {ratio:>6.2f} "
                  f"{1.2 / sp:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
