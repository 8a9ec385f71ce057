"""FlexAttention's forward (local="flex") against the fused CPU kernel's (local="fused"), per
variant, side by side in one run on one rank (the local kernels alone: no exchange):

    python bench/flex.py [--seq-lens 4096,8192] [--repeats 3]

Off CUDA, flex runs its eager path (it materialises the scores, [B, H, S, S] fp32) and, with
--compiled, torch.compile's CPU kernel too (inference only). Prints each variant's median
forward time and the ratio flex / fused.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

import ulysses
import ulysses.flex

VARIANTS = {
    "causal": ({"causal": True}, ()),
    "documents": ({"causal": True}, ("positions",)),
    "window": ({"causal": True, "window": 512}, ()),
    "softcap": ({"causal": True, "softcap": 30.0}, ()),
    "padding": ({"causal": True}, ("padding",)),
    "sinks": ({"causal": True}, ("sinks",)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="4096,8192")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--heads", default="8,2", help="query and kv heads")
    p.add_argument("--compiled", action="store_true", help="also torch.compile's CPU flex (inference)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        hq, hkv = (int(x) for x in a.heads.split(","))
        print(f"forward only, B=1, Hq={hq} Hkv={hkv} D=64, fp32, {torch.get_num_threads()} threads, "
              f"median of {a.repeats}; flex off CUDA: eager (scores materialised)")
        print(f"{'S':>6} {'variant':<10} {'fused_ms':>9} {'flex_ms':>9} {'flex/fused':>10}"
              + (f" {'compiled_ms':>11} {'compiled/fused':>14}" if a.compiled else ""))
        for S in (int(s) for s in a.seq_lens.split(",")):
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(1, S, hq, 64, generator=gen)
            k, v = (torch.randn(1, S, hkv, 64, generator=gen) for _ in range(2))
            positions = (torch.arange(S) % (S // 4))[None]  # four documents
            keep = torch.ones(1, S, dtype=torch.bool)
            keep[:, -S // 8:] = False
            extras = {"positions": positions, "padding": keep[:, None, None, :].expand(1, 1, S, S),
                      "sinks": torch.randn(hq, generator=gen)}
            for name, (options, given) in VARIANTS.items():
                call = {}
                if "positions" in given:
                    call["position_ids"] = extras["positions"]
                if "padding" in given:
                    call["mask"] = extras["padding"]
                if "sinks" in given:
                    call["sinks"] = extras["sinks"]
                layers = {local: ulysses.DistributedAttention(dist.group.WORLD, local=local, **options)
                          for local in ("fused", "flex")}
                runs = [functools.partial(layers[local], q, k, v, **call) for local in ("fused", "flex")]
                compiled = functools.partial(_compiled_flex, q, k, v, hq, hkv, options, call)
                failed = ""
                if a.compiled:
                    torch._dynamo.reset()  # each variant its own compiles, never past the recompile limit
                    try:
                        with torch.no_grad():
                            compiled()  # compiles
                        runs.append(compiled)
                    except Exception as e:  # torch's CPU flex compiler fails some mask captures
                        failed = type(e).__name__
                times: list[list[float]] = [[] for _ in runs]
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for fn in runs:
                        fn()  # warm-up
                    for _ in range(a.repeats):
                        for i, fn in enumerate(runs):  # side by side
                            t0 = time.perf_counter()
                            fn()
                            times[i].append(1e3 * (time.perf_counter() - t0))
                med = [statistics.median(t) for t in times]
                line = f"{S:>6} {name:<10} {med[0]:>9.1f} {med[1]:>9.1f} {med[1] / med[0]:>10.2f}"
                if a.compiled:
                    line += f" {med[2]:>11.1f} {med[2] / med[0]:>14.2f}" if not failed else f"  ({failed})"
                print(line, flush=True)
        dist.destroy_process_group()


def _compiled_flex(q, k, v, hq, hkv, options, call):
    """torch.compile's CPU flex on the same heads (the local kernel alone, BHSD)."""
    kv_map = [h * hkv // hq for h in range(hq)]
    mask = call.get("mask")
    positions = call.get("position_ids")
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    return ulysses.flex.attention(qh, kh, vh, kv_map, mask, positions, options.get("causal", False), None,
                                  options.get("window", 0), options.get("softcap", 0.0), compiled=True,
                                  sinks=call.get("sinks"))


if __name__ == "__main__":
    main()
