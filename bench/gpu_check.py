"""ulysses on CUDA tensors: the GPU check that scripts/gpu_check.sh runs on a machine with an
NVIDIA GPU (nothing here runs without one).

    python bench/gpu_check.py [--nproc 2] [--json FILE]

1. Correctness, forward and q/k/v gradients against SDPA in float64 on one GPU, fp32 and bf16:
   GQA with Hkv < P, uneven heads, S not divisible by P, a query-sharded padding mask, causal.
   With a GPU per rank the ranks talk over NCCL; with one GPU every rank shares it over a Gloo
   group (Gloo stages CUDA tensors through host memory), which still runs every CUDA code path
   of ours (packing, masks, SDPA) though not NCCL.
2. All-to-all (NCCL only): ours (q, k, v in one fused call) against a bare all_to_all_single of
   the same bytes into preallocated buffers, bus bandwidth at 1M to 256M elements per rank.
3. The attention layer forward+backward (bf16, causal, Hq 32 / Hkv 8, D 128) at S = 32K, 64K,
   128K: time (CUDA events, slowest rank) and peak memory per rank.
Exits 1 if a correctness case misses its tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

CASES = [  # name, S, Hq, Hkv, causal, padded
    ("GQA 8/1 (Hkv < P), causal", 1000, 8, 1, True, False),
    ("uneven heads 15/5", 1003, 15, 5, False, False),
    ("padding mask, S not divisible", 997, 8, 8, False, True),
]
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def reference(q, k, v, mask, causal):
    """SDPA in float64 on [B, S, H, D] tensors (kv heads repeated for GQA)."""
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (t.repeat_interleave(rep, 2).transpose(1, 2) for t in (k, v))
    if causal and mask is not None:
        mask = mask & torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None)
    return out.transpose(1, 2), (q, k, v)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def correctness(rank, P, group, device):
    import ulysses

    rows = []
    for name, S, hq, hkv, causal, padded in CASES:
        lens = ulysses.plan(hq, hkv, P, S)["seq_lens"]
        start = sum(lens[:rank])
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator(device=device).manual_seed(7)
            q, k, v = (torch.randn(2, S, h, 64, generator=gen, device=device, dtype=dtype) for h in (hq, hkv, hkv))
            mask = None
            if padded:
                keep = torch.ones(2, S, dtype=torch.bool, device=device)
                keep[0, : S // 5] = False
                mask = keep[:, None, None, :].expand(2, 1, S, S)
            ref, (rq, rk, rv) = reference(q, k, v, mask, causal)
            grad = torch.randn(ref.shape, generator=gen, device=device, dtype=ref.dtype)
            ref.backward(grad)
            attn = ulysses.DistributedAttention(group, causal=causal)
            mine = [t.narrow(1, start, lens[rank]).detach().requires_grad_() for t in (q, k, v)]
            local_mask = None if mask is None else mask.narrow(2, start, lens[rank])
            out = attn(*mine, mask=local_mask, seq_lens=lens)
            out.backward(grad.narrow(1, start, lens[rank]).to(dtype))
            errors = [rel(out, ref.narrow(1, start, lens[rank]))]
            errors += [rel(m.grad, r.grad.narrow(1, start, lens[rank])) for m, r in zip(mine, (rq, rk, rv))]
            worst = max(errors)
            rows.append({"case": name, "dtype": str(dtype).split(".")[1], "worst_rel_error": worst,
                         "ok": worst <= TOLERANCE[dtype]})
    return rows


def bus_bandwidth(rank, P, group, timer, device):
    """GB/s of ours and of a bare all_to_all_single moving the same bytes (NCCL only)."""
    import ulysses

    rows = []
    for elements in (1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28):
        H, D = 32, 128
        S_r = max(1, elements // (H * D))
        x = torch.randn(1, S_r, H, D, device=device, dtype=torch.bfloat16)
        lens = [S_r] * P
        send = x.reshape(-1).clone()
        recv = torch.empty_like(send)

        def ours(x=x, lens=lens, H=H):
            qh = ulysses.scatter_heads([x], ["q"], H, H, lens, group=group)[0]
            return ulysses.gather_heads([qh], ["q"], H, H, lens, group=group)[0]

        def bare(send=send, recv=recv):
            dist.all_to_all_single(recv, send, group=group)
            dist.all_to_all_single(send, recv, group=group)

        row = {"elements": S_r * H * D}
        for label, fn in (("ours", ours), ("bare", bare)):
            ms = cuda_ms(fn, timer)
            moved = 2 * x.numel() * x.element_size() * (P - 1) / P  # bytes per rank, both ways
            row[f"{label}_ms"], row[f"{label}_GBps"] = ms, moved / ms / 1e6
        rows.append(row)
    return rows


def layer(rank, P, group, timer, device):
    import ulysses

    rows = []
    for S in (32768, 65536, 131072):
        hq, hkv, D = 32, 8, 128
        S_r = S // P
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        q, k, v = (torch.randn(1, S_r, h, D, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for h in (hq, hkv, hkv))
        attn = ulysses.DistributedAttention(group, causal=True)
        base = torch.cuda.memory_allocated(device)

        def step(attn=attn, qkv=(q, k, v), lens=[S_r] * P):
            attn(*qkv, seq_lens=lens).sum().backward()

        ms = cuda_ms(step, timer, repeats=3)
        peak = torch.cuda.max_memory_allocated(device) - base
        rows.append({"seq_len": S, "ms": ms, "peak_extra_MiB": peak / 2**20})
    return rows


def cuda_ms(fn, timer, repeats=5):
    """Median CUDA-event milliseconds of ``fn``, the slowest rank's (over the Gloo group
    ``timer``)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        dist.barrier(timer)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=timer)
        samples.append(t.item())
    return sorted(samples)[len(samples) // 2]


def worker(rank, P, nccl, store, out):
    torch.cuda.set_device(rank if nccl else 0)
    device = torch.device("cuda", torch.cuda.current_device())
    backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=P)
    group = dist.group.WORLD
    timer = dist.new_group(backend="gloo")  # CPU timings are gathered over Gloo
    result = {"correctness": correctness(rank, P, group, device)}
    if nccl:
        result["a2a"] = bus_bandwidth(rank, P, group, timer, device)
    result["layer"] = layer(rank, P, group, timer, device) if nccl or P == 1 else []
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default="")
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("gpu_check: no CUDA device")
        return 1
    nccl = gpus >= args.nproc
    print(f"gpu_check: {torch.cuda.get_device_name(0)} x{gpus}, torch {torch.__version__}, "
          f"{args.nproc} ranks over {'NCCL' if nccl else 'Gloo on one GPU'}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for P, over_nccl in ((args.nproc, nccl), (1, True)):  # then one rank: the layer alone
            out = os.path.join(tmp, f"result{P}")
            mp.start_processes(worker, args=(P, over_nccl, os.path.join(tmp, f"store{P}"), out),
                               nprocs=P, start_method="spawn")
            with open(out) as f:
                results[P] = json.load(f)
    ok = True
    for P, r in results.items():
        for c in r["correctness"]:
            ok &= c["ok"]
            print(f"  P={P} {c['case']:32s} {c['dtype']:9s} worst rel. error {c['worst_rel_error']:.1e} "
                  f"{'ok' if c['ok'] else 'FAILED'}")
        for a in r.get("a2a", []):
            print(f"  P={P} a2a {a['elements']:>10d} elements/rank: ours {a['ours_GBps']:7.1f} GB/s, bare "
                  f"{a['bare_GBps']:7.1f} GB/s, ours/bare time {a['ours_ms'] / a['bare_ms']:.2f}")
        for t in r["layer"]:
            print(f"  P={P} layer S={t['seq_len']:6d} fwd+bwd {t['ms']:8.1f} ms, peak +{t['peak_extra_MiB']:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
