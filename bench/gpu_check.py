"""ulysses on a GPU: the one prepared check that scripts/gpu_check.sh runs on a machine with an
NVIDIA GPU, and that CI runs on the CPU (``--device cpu --quick``) so that the check itself
cannot fail on its first GPU run for a reason a CPU would show.

    python bench/gpu_check.py [--device cuda|cpu] [--quick] [--out DIR]

Parts, each guarded (one that fails does not hide the rest); DIR gets gpu_check.json (every
number) and summary.txt (a line per result):

1. host_sync (CUDA): attention calls at P = 1 over NCCL return while the GPU is still busy
   with a sleep queued before them: no host synchronisation in the call path. Expected: every
   row returns before the GPU (causal and GQA on SDPA; padding and documents on FlexAttention,
   whose block mask and the ids' split check are the step's, made in the warm-up call with the
   same StepContext; without one, a documents call reads the ids once, a sync).
2. local: every local-attention case (plain, causal, GQA, padding mask, packed documents,
   window, softcap, sinks) in fp32 and bf16, forward and q/k/v gradients against float64, on
   the rule's kernel and on FlexAttention; then (not --quick) each case at S = 8K and 32K in
   bf16: the kernel the rule chose (on CUDA: SDPA for plain, causal, GQA; FlexAttention for the
   rest), fwd+bwd time against the plain case's, peak memory; and at 8K the C++ API's kernel
   (SDPA with a dense mask, or math) for contrast.
3. sweep: 2 processes (one GPU: Gloo carries CUDA tensors in its collectives), under both
   transports (messages, batched): DistributedAttention against float64 (GQA with Hkv < P,
   uneven heads, a padding mask with S not divisible, packed documents, a window, a softcap,
   sinks; on CUDA each on the kernel local="auto" picks there),
   the projected exchange round trip (point-to-point: on CPU tensors only, since Gloo's
   send/recv take host memory), a tiny Llama through ulysses.hf against the unsharded
   model, and ulysses.hf.verify of a tiny Qwen3-Next (gated delta-nets), Bamba (Mamba-2), LFM2
   (short convolutions) and Qwen2.5-VL (an image, the vision tower encoding each frame once):
   their models' own kernels, the hub's fast ones on a GPU where installed.
4. checkpoint: ulysses.tiled.checkpoint(mode="offload") over layers with dropout: gradients equal
   the plain run's under the same seed; on CUDA the peak memory is lower.
5. layer: DistributedAttention at P = 1, bf16, causal, Hq 32 / Hkv 8,
   D 128, at S = 32K, 64K, 128K (--quick: 8K; on CPU a small fp32 case): fwd+bwd time and
   peak, against torch's SDPA (kv heads expanded), and with head_chunks=4 (Note [Head chunks]; time and peak),
   also recomputed in backward (recompute_chunks: its gradients the chunked call's, then time and peak).
6. device_group: 2 processes on a group registered for the device alone (Gloo underneath, as
   NCCL would be): the group keeps its name through two DistributedAttention modules, the loss
   and gradient helpers stay exact, and ULYSSES_TRANSPORT=messages runs (batched off the CPU).
7. compiles: the graphs torch.compile made over the whole check (dynamo's default recompile
   limit, never raised here), and flex's compiled calls and block masks: a model's layers must
   compile a bounded number of times.

Exits 1 if any part failed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from reference import reference_attention  # noqa: E402  (float64, torch primitives only)

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def guarded(fn: Callable[[], dict]) -> dict:
    """Runs one part; an exception becomes its result (ok False, the error and where)."""
    t0 = time.perf_counter()
    try:
        out = fn()
        out.setdefault("ok", all(r.get("ok", True) for r in out.get("rows", [])))
    except Exception as e:  # noqa: BLE001  (a part's failure is data, not the end of the check)
        out = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
               "trace": traceback.format_exc(limit=6)}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_reset(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_mib(device: torch.device, base: int) -> float | None:
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None


# ---- local attention ---------------------------------------------------------------------------

LOCAL_CASES = ["plain", "causal", "gqa", "padding mask", "packed documents", "window", "softcap", "sinks"]


def local_inputs(case: str, B: int, S: int, hq: int, D: int, dtype, device, seed: int = 0) -> tuple:
    """q, k, v ``[B, S, H, D]`` (BSHD, the reference's) and the call's options for ``case``."""
    gen = torch.Generator().manual_seed(seed)
    hkv = hq // 4 if case == "gqa" else hq
    q, k, v = (torch.randn(B, S, h, D, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
    opts: dict = {"causal": case in ("causal", "gqa", "packed documents", "window")}
    if case == "padding mask":
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
        keep[0, ..., : S // 5] = False
        opts["mask"] = keep.to(device)
    elif case == "packed documents":
        cut = [S // 3, S // 2, S - S // 3 - S // 2]
        opts["positions"] = torch.cat([torch.arange(n) for n in cut]).expand(B, S).contiguous().to(device)
    elif case == "window":
        opts["window"] = max(2, S // 8)
    elif case == "softcap":
        opts["softcap"] = 2.0
        q, k = q * 3, k * 3  # scores large enough for the cap to matter
    elif case == "sinks":
        opts["sinks"] = torch.randn(hq, generator=gen).to(device, torch.float32)
    return q, k, v, opts


def run_local(q, k, v, opts, kernel: str = "auto") -> torch.Tensor:
    """ulysses.local_attention (BHSD) on BSHD inputs, returning BSHD: the rule's kernel ("auto":
    on CUDA, SDPA or FlexAttention, Note [Local attention by case]) or the one named."""
    import ulysses

    hq, hkv = q.shape[2], k.shape[2]
    kv_map = [h // (hq // hkv) for h in range(hq)]
    o = ulysses.local_attention(*(t.transpose(1, 2) for t in (q, k, v)), kv_map, mask=opts.get("mask"),
                                positions=opts.get("positions"), causal=opts["causal"], kernel=kernel,
                                window=opts.get("window", 0), softcap=opts.get("softcap"), sinks=opts.get("sinks"))
    return o.transpose(1, 2)


def chosen_kernel(q, opts) -> str:
    import ulysses

    return ulysses.local_kernel(q.transpose(1, 2), opts.get("mask"), opts.get("positions"), opts["causal"],
                                opts.get("window", 0), opts.get("softcap"), opts.get("sinks"))


def reference_of(q, k, v, opts, grad):
    """float64 output and q/k/v gradients on the CPU."""
    ins = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in opts.items()}
    out = reference_attention(*ins, mask=cpu.get("mask"), positions=cpu.get("positions"), causal=cpu["causal"],
                              window=cpu.get("window", 0), softcap=cpu.get("softcap", 0.0), sinks=cpu.get("sinks"))
    out.backward(grad.detach().cpu().double())
    return out, [t.grad for t in ins]


def local_part(device: torch.device, quick: bool) -> dict:
    rows = []
    S = 64 if quick else 256
    for case in LOCAL_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, opts = local_inputs(case, 2, S, 8, 32, dtype, device)
            mine = [t.detach().requires_grad_() for t in (q, k, v)]
            out = run_local(*mine, opts)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
            out.backward(grad)
            ref, ref_grads = reference_of(q, k, v, opts, grad)
            worst = max([rel(out, ref)] + [rel(m.grad, r) for m, r in zip(mine, ref_grads)])
            rows.append({"case": case, "dtype": str(dtype)[6:], "S": S, "kernel": chosen_kernel(q, opts),
                         "worst_rel_error": worst, "ok": worst <= TOLERANCE[dtype]})
            # local="flex": fwd+bwd on CUDA in bf16 (each compile costs seconds); forward only elsewhere.
            if device.type != "cuda" or dtype == torch.bfloat16:
                rows.append(guarded(functools.partial(flex_row, q, k, v, opts, grad, ref, ref_grads, dtype, case, S)))
    # At length: the rule's kernel for each case (on CUDA: SDPA's flash for plain, causal and GQA,
    # FlexAttention for the rest), against the plain case's time; peak memory at both lengths
    # (S^2 growth would be 16x from 8K to 32K). Then the C++ API's kernel at 8K, for contrast.
    long = [] if quick else [8192, 32768] if device.type == "cuda" else [2048]
    for S in long:
        for case in LOCAL_CASES:
            rows.append(guarded(lambda case=case, S=S: local_at_length(case, S, device)))
        plain = next((r.get("ms") for r in rows if r.get("case") == "plain" and r.get("S") == S), None)
        for r in rows:
            if r.get("S") == S and r.get("ms") and plain:
                r["over_plain"] = r["ms"] / plain
    for case in LOCAL_CASES if device.type == "cuda" and not quick else ():
        rows.append(guarded(lambda case=case: local_at_length(case, long[0], device, kernel="c++ rule")))
    return {"rows": rows}


def flex_row(q, k, v, opts, grad, ref, ref_grads, dtype, case: str, S: int) -> dict:
    backward = q.is_cuda
    mine = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's "without torch.compile" off CUDA
        out = run_local(*mine, opts, kernel="flex")
    worst = rel(out, ref)
    if backward:
        out.backward(grad)
        worst = max([worst] + [rel(m.grad, r) for m, r in zip(mine, ref_grads)])
    return {"case": case, "dtype": str(dtype)[6:], "S": S, "kernel": "flex" + ("" if backward else " (forward)"),
            "worst_rel_error": worst, "ok": worst <= TOLERANCE[dtype]}


def local_at_length(case: str, S: int, device: torch.device, kernel: str = "auto") -> dict:
    """fwd+bwd of one case at length S in bf16 (B 1, Hq 16, D 128): kernel, time, peak.
    ``kernel="c++ rule"``: the C++ API's choice (ulysses.local_attention's op, no Python rule)."""
    q, k, v, opts = local_inputs(case, 1, S, 16, 128, torch.bfloat16, device)
    ins = [t.requires_grad_() for t in (q, k, v)]
    if kernel == "c++ rule":
        from ulysses import _C

        name = _C.chosen_local_kernel(q.device.type, q.dtype, "mask" in opts, "positions" in opts,
                                      opts.get("window", 0), opts.get("softcap", 0.0), "sinks" in opts,
                                      by_cpp=True)
        row = {"case": case, "S": S, "kernel": f"{name} (C++ API)"}
        kernel = name
    else:
        row = {"case": case, "S": S, "kernel": chosen_kernel(q, opts) if kernel == "auto" else kernel}

    def step():
        run_local(*ins, opts, kernel=kernel).sum().backward()

    step()  # warm-up (and any compile)
    base = peak_reset(device)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(2):
        step()
    synchronize(device)
    row["ms"] = (time.perf_counter() - t0) / 2 * 1e3
    row["peak_MiB"] = peak_mib(device, base)
    return row


# ---- host synchronisation ----------------------------------------------------------------------

def host_sync_part(device: torch.device, tmp: str) -> dict:
    if device.type != "cuda":
        return {"skipped": "needs CUDA (streams)"}
    out = os.path.join(tmp, "host_sync.json")
    mp.start_processes(_host_sync_worker, args=(os.path.join(tmp, "store_sync"), out), nprocs=1, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def _host_sync_worker(rank: int, store: str, out: str) -> None:
    import ulysses

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    rows = []
    try:
        for case in ("causal", "gqa", "padding mask", "packed documents"):
            q, k, v, opts = local_inputs(case, 1, 1024, 8, 64, torch.bfloat16, torch.device("cuda"))
            attn = ulysses.DistributedAttention(dist.group.WORLD, causal=opts["causal"])
            extra = {"mask": opts["mask"].expand(1, 1, 1024, 1024)} if "mask" in opts else {}
            if "positions" in opts:
                extra["position_ids"] = opts["positions"]
            extra["step"] = ulysses.StepContext()  # the step's block mask and ids check, made once
            attn(q, k, v, **extra)  # warm-up (and the compile)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e8))  # ~0.1-0.2 s of GPU time ahead of the call
            t0 = time.perf_counter()
            attn(q, k, v, **extra)
            host_ms = (time.perf_counter() - t0) * 1e3
            busy = not torch.cuda.current_stream().query()
            torch.cuda.synchronize()
            rows.append({"case": case, "host_ms": host_ms, "returned_before_gpu": busy, "ok": busy})
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rows": rows}, f)


# ---- two ranks ---------------------------------------------------------------------------------

SWEEP = [  # name, S, Hq, Hkv, case (local_inputs' options)
    ("GQA 8/1 (Hkv < P), causal", 100, 8, 1, "causal"),
    ("uneven heads 6/2", 103, 6, 2, "plain"),
    ("padding mask, S not divisible", 97, 8, 8, "padding mask"),
    ("packed documents", 96, 8, 8, "packed documents"),
    ("window", 96, 8, 8, "window"),
    ("softcap", 96, 8, 8, "softcap"),
    ("sinks", 96, 8, 8, "sinks"),
]


def _two_ranks(worker, name: str, device: torch.device, tmp: str) -> dict:
    """Runs ``worker(rank, device, store, out)`` on two spawned ranks; returns what it wrote to ``out``."""
    out = os.path.join(tmp, f"{name}.json")
    mp.start_processes(worker, args=(str(device), os.path.join(tmp, f"store_{name}"), out), nprocs=2,
                       start_method="spawn")
    with open(out) as f:
        return json.load(f)


def sweep_part(device: torch.device, tmp: str) -> dict:
    return _two_ranks(_sweep_worker, "sweep", device, tmp)


def _sweep_worker(rank: int, device_name: str, store: str, out: str) -> None:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU: Gloo carries CUDA tensors
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.group.WORLD
    rows = []
    for transport in ("messages", "batched"):
        os.environ["ULYSSES_TRANSPORT"] = transport  # read by every call's group options
        for name, S, hq, hkv, case in SWEEP:
            for dtype in (torch.float32, torch.bfloat16):
                run = functools.partial(_attention_row, rank, group, device, S, hq, hkv, case, dtype)
                rows.append(_guarded_row(run, transport=transport, check=name, dtype=str(dtype)[6:]))
        rows.append(_guarded_row(lambda: _projected_row(rank, group, device), transport=transport,
                                 check="projected exchange round trip", dtype="float32"))
        rows.append(_guarded_row(lambda: _hf_row(rank, group, device), transport=transport,
                                 check="tiny Llama through ulysses.hf", dtype="float32"))
        for family in HYBRID_FAMILIES:
            rows.append(_guarded_row(functools.partial(_verify_row, rank, group, device, family), transport=transport,
                                     check=f"tiny {family} through ulysses.hf.verify", dtype="float32"))
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f)


def _guarded_row(fn: Callable[[], dict], **labels) -> dict:
    row = guarded(fn)
    row.pop("seconds", None)
    return {**labels, **row}


def _attention_row(rank, group, device, S, hq, hkv, case, dtype) -> dict:
    import ulysses

    lens = ulysses.plan(hq, hkv, 2, S)["seq_lens"]
    start, n = sum(lens[:rank]), lens[rank]
    q, k, v, opts = local_inputs(case, 2, S, hq, 16, dtype, device, seed=7)
    grad = torch.randn(2, S, hq, 16, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    ref, ref_grads = reference_of(q, k, v, opts, grad)
    attn = ulysses.DistributedAttention(group, causal=opts["causal"], window=opts.get("window"),
                                        softcap=opts.get("softcap"), timeout=60)
    mine = [t.narrow(1, start, n).detach().requires_grad_() for t in (q, k, v)]
    extra = {}
    if "mask" in opts:  # query rows sharded: this rank's rows of the [B, 1, S, S] mask
        extra["mask"] = opts["mask"].expand(2, 1, S, S).narrow(2, start, n)
    if "positions" in opts:
        extra["position_ids"] = opts["positions"].narrow(1, start, n)
    if "sinks" in opts:
        extra["sinks"] = opts["sinks"]
    out = attn(*mine, seq_lens=lens, **extra)
    out.backward(grad.narrow(1, start, n))
    worst = max([rel(out, ref.narrow(1, start, n))] +
                [rel(m.grad, r.narrow(1, start, n)) for m, r in zip(mine, ref_grads)])
    return {"worst_rel_error": worst, "ok": worst <= TOLERANCE[dtype]}


def _projected_row(rank, group, device) -> dict:
    """gather_projected(scatter_projected(x, Wq), Wo) == x Wq^T Wo^T on this rank's tokens, and
    the gradients of x, Wq and Wo (summed over ranks) equal the single-process ones."""
    import ulysses

    if device.type != "cpu":  # Gloo's send/recv take host memory; the batched path needs NCCL
        return {"skipped": "point-to-point on CUDA tensors needs NCCL (a GPU per rank)"}

    B, S, E, hq, hkv, D = 2, 37, 24, 6, 2, 8
    lens = ulysses.plan(hq, hkv, 2, S)["seq_lens"]
    start, n = sum(lens[:rank]), lens[rank]
    gen = torch.Generator().manual_seed(11)
    X, Wq, Wk, Wo, W = (torch.randn(*s, generator=gen).to(device) for s in
                        ((B, S, E), (hq * D, E), (hkv * D, E), (E, hq * D), (B, S, E)))
    ref_in = [t.detach().double().requires_grad_() for t in (X, Wq, Wo)]
    ref = F.linear(F.linear(ref_in[0], ref_in[1]), ref_in[2])
    (ref * W.double()).sum().backward()
    x, wq, wk, wo = (t.detach().requires_grad_() for t in (X.narrow(1, start, n), Wq, Wk, Wo))
    ys = ulysses.scatter_projected(x, [wq, wk], [None, None], ["q", "kv"], hq, hkv, lens, group=group)
    out = ulysses.gather_projected(ys[0], wo, hq, hkv, lens, group=group)
    (out * W.narrow(1, start, n)).sum().backward()
    for g in (wq.grad, wo.grad):
        dist.all_reduce(g, group=group)
    errors = [rel(out, ref.narrow(1, start, n)), rel(x.grad, ref_in[0].grad.narrow(1, start, n)),
              rel(wq.grad, ref_in[1].grad), rel(wo.grad, ref_in[2].grad)]
    return {"worst_rel_error": max(errors), "ok": max(errors) <= 1e-5}


def _hf_row(rank, group, device) -> dict:
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError:
        return {"skipped": "transformers is not installed"}
    import ulysses.hf as uhf

    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, attention_dropout=0.0, use_cache=False,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().to(device)
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1)).to(device)
    ref_model = copy.deepcopy(base)
    ref_out = ref_model(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    model = uhf.sequence_parallel(copy.deepcopy(base), group)
    sb = uhf.shard_batch({"input_ids": ids}, group)
    out = model(input_ids=sb["input_ids"], position_ids=sb["position_ids"], ulysses_seq_lens=sb["seq_lens"])
    loss, global_loss = uhf.sequence_parallel_loss(out.logits, sb["shift_labels"], group)
    loss.backward()
    uhf.all_reduce_gradients(model, group)
    errors = [abs(global_loss.item() - ref_out.loss.item()) / abs(ref_out.loss.item())]
    grads = dict(ref_model.named_parameters())
    errors += [rel(p.grad, grads[name].grad) for name, p in model.named_parameters()]
    return {"worst_rel_error": max(errors), "ok": max(errors) <= 1e-4}


# Hybrids' mixers and VLMs (ulysses.hybrid, ulysses.vision): their models' own kernels, which on a
# GPU are the hub's fast ones where installed (causal-conv1d, flash-linear-attention, mamba-ssm).
HYBRID_FAMILIES = ("qwen3_next", "bamba", "lfm2", "qwen2_5_vl")


def _verify_row(rank, group, device, family: str) -> dict:
    """One ulysses.hf.verify of a tiny model of ``family`` on the device: the sharded model's loss
    and every gradient against itself unsharded."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed"}
    import ulysses.hf as uhf

    model, batch = _tiny_model_and_batch(family)
    model = uhf.sequence_parallel(model.float().to(device), group)
    batch = {k: v.to(device) for k, v in batch.items()}
    result = uhf.verify(model, batch, group)
    # fp32 through a linear-time mixer: its decay parameters' gradients (Qwen3-Next's dt_bias) sum
    # many terms, 2.8e-4 apart sharded and unsharded on an Intel host (below 1e-4 on an AMD one).
    return {"worst_rel_error": result.worst[1], "worst": result.worst[0], "ok": result.worst[1] <= 1e-3}


def _tiny_model_and_batch(family: str) -> tuple:
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 59, (2, 23), generator=gen)
    if family == "qwen2_5_vl":
        text = dict(common, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4})
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                                                 out_hidden_size=32, fullatt_block_indexes=[1], window_size=56),
            image_token_id=60, video_token_id=61, vision_start_token_id=62)
        ids[:, 9], ids[:, 10:14] = 62, 60  # one image of 4 merged tokens, straddling the shard boundary
        batch = {"input_ids": ids, "pixel_values": torch.randn(32, 3 * 2 * 14 * 14, generator=gen),
                 "image_grid_thw": torch.tensor([[1, 4, 4]] * 2), "mm_token_type_ids": (ids == 60).long()}
        return AutoModelForImageTextToText.from_config(config), batch
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(layer_types=["linear_attention", "full_attention"], head_dim=8,
                                              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                              linear_value_head_dim=8, mlp_only_layers=[0, 1], **common)
    elif family == "bamba":
        config = transformers.BambaConfig(attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_head=8,
                                          mamba_d_state=8, mamba_expand=1, mamba_chunk_size=8, **common)
    else:
        config = transformers.Lfm2Config(layer_types=["conv", "full_attention"], conv_L_cache=3, **common)
    return AutoModelForCausalLM.from_config(config), {"input_ids": ids}


# ---- checkpoint --------------------------------------------------------------------------------

def checkpoint_part(device: torch.device, quick: bool) -> dict:
    """Four blocks (Linear, Dropout, GELU), each checkpointed with offload, against the plain
    stack: the same dropout draws (the generators replayed), so the same gradients."""
    from ulysses import tiled

    width, rows = (64, 256) if quick else (1024, 16384)
    torch.manual_seed(4)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Dropout(0.3), torch.nn.GELU()).to(device)
              for _ in range(4)]
    params = [p for b in blocks for p in b.parameters()]
    x0 = torch.randn(rows, width, generator=torch.Generator().manual_seed(5)).to(device)

    def run(checkpointed: bool):
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        torch.manual_seed(9)  # seeds the CPU and every CUDA generator
        base = peak_reset(device)
        with tiled.offload_scope():
            h = x
            for b in blocks:
                h = tiled.checkpoint(b, h, mode="offload") if checkpointed else b(h)
            (h.float() ** 2).mean().backward()
        synchronize(device)
        return [x.grad] + [p.grad.clone() for p in params], peak_mib(device, base)

    plain, plain_peak = run(False)
    ckpt, ckpt_peak = run(True)
    worst = max(rel(a, b) for a, b in zip(ckpt, plain))
    row = {"worst_rel_error": worst, "plain_peak_MiB": plain_peak, "offload_peak_MiB": ckpt_peak,
           "ok": worst <= 1e-6 and (ckpt_peak is None or ckpt_peak < plain_peak)}
    return {"rows": [row]}


# ---- the layer at long S -----------------------------------------------------------------------

def layer_part(device: torch.device, quick: bool, tmp: str) -> dict:
    """One rank (its own 1-rank group: NCCL on CUDA, Gloo on CPU)."""
    if device.type != "cuda":
        lengths, hq, hkv, D, dtype = ([512] if quick else [4096]), 8, 2, 64, torch.float32
    else:
        lengths, hq, hkv, D, dtype = ([8192] if quick else [32768, 65536, 131072]), 32, 8, 128, torch.bfloat16
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{os.path.join(tmp, 'store_layer')}", rank=0, world_size=1)
    try:
        return {"rows": [guarded(lambda S=S: layer_at_length(S, hq, hkv, D, dtype, device)) for S in lengths]}
    finally:
        dist.destroy_process_group()


def layer_at_length(S: int, hq: int, hkv: int, D: int, dtype, device: torch.device) -> dict:
    import ulysses

    q, k, v = (torch.randn(1, S, h, D, device=device, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    attn = ulysses.DistributedAttention(dist.group.WORLD, causal=True)
    chunks = min(4, hkv)  # Note [Head chunks]: 4 on the GPU's 32/8 heads
    chunked = ulysses.DistributedAttention(dist.group.WORLD, causal=True, head_chunks=chunks)
    recomputed = ulysses.DistributedAttention(dist.group.WORLD, causal=True, head_chunks=chunks,
                                              recompute_chunks=True)

    def sdpa():
        rep = hq // hkv  # kv heads expanded: SDPA's flash backend then applies
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                                           v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)

    row = {"S": S}
    # Recomputed chunks (Note [Recomputed chunks]) give the chunked call's gradients: the same
    # kernels on the same heads, run again.
    grads = []
    for module in (chunked, recomputed):
        q.grad = k.grad = v.grad = None
        module(q, k, v).float().square().mean().backward()
        grads.append([t.grad.float() for t in (q, k, v)])
    row["recomputed_grad_rel"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(*grads))
    if row["recomputed_grad_rel"] > 1e-2:
        raise AssertionError("recomputed chunks' gradients differ from the chunked call's: "
                             f"{row['recomputed_grad_rel']}")
    q.grad = k.grad = v.grad = None
    for label, fn in (("ulysses", lambda: attn(q, k, v)), ("chunked", lambda: chunked(q, k, v)),
                      ("recomputed", lambda: recomputed(q, k, v)), ("sdpa", sdpa)):
        fn().sum().backward()
        base = peak_reset(device)
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            fn().sum().backward()
        synchronize(device)
        row[f"{label}_ms"] = (time.perf_counter() - t0) / 3 * 1e3
        row[f"{label}_peak_MiB"] = peak_mib(device, base)
    row["ulysses_over_sdpa"] = row["ulysses_ms"] / row["sdpa_ms"]
    row["head_chunks"] = chunks
    row["chunked_over_ulysses"] = row["chunked_ms"] / row["ulysses_ms"]
    row["recomputed_over_ulysses"] = row["recomputed_ms"] / row["ulysses_ms"]
    return row


# ---- a group registered for the device alone -----------------------------------------------------

def device_group_part(device: torch.device, tmp: str) -> dict:
    return _two_ranks(_device_group_worker, "device_group", device, tmp)


def _device_only_backend(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)  # Gloo carries the device's tensors here


def _device_group_worker(rank: int, device_name: str, store: str, out: str) -> None:
    import ulysses
    import ulysses.training as T

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    dist.Backend.register_backend("ulysses_device_only", _device_only_backend, devices=[device.type])
    group = dist.new_group(backend="ulysses_device_only")
    name = group.group_name
    rows = []
    S, lens = 96, [48, 48]
    q, k, v, opts = local_inputs("causal", 2, S, 8, 16, torch.float32, device, seed=3)
    ref = reference_attention(*(t.cpu().double() for t in (q, k, v)), causal=True)
    for transport in ("auto", "messages"):
        os.environ["ULYSSES_TRANSPORT"] = transport  # messages: batched anyway off the CPU
        for i in range(2):
            def row(i=i):
                attn = ulysses.DistributedAttention(group, causal=True, timeout=60)
                o = attn(*(t.narrow(1, 48 * rank, 48) for t in (q, k, v)), seq_lens=lens)
                err = rel(o, ref.narrow(1, 48 * rank, 48))
                return {"worst_rel_error": err, "name_kept": group.group_name == name,
                        "ok": err <= TOLERANCE[torch.float32] and group.group_name == name}
            rows.append(_guarded_row(row, check=f"DistributedAttention {i + 1}", transport=transport))
    os.environ.pop("ULYSSES_TRANSPORT", None)

    def helpers():
        layer = torch.nn.Linear(3, 1, bias=False).to(device)
        layer.weight.grad = torch.full((1, 3), float(rank + 1), device=device)
        T.all_reduce_gradients(layer, group)
        ids = torch.arange(20).view(2, 10) % 7
        shard = T.shard_batch({"input_ids": ids}, group)
        return {"gradient_sum": layer.weight.grad.flatten().tolist(), "tokens": shard["input_ids"].shape[1],
                "ok": bool((layer.weight.grad == 3).all()) and shard["input_ids"].shape[1] == 5}
    rows.append(_guarded_row(helpers, check="gradients and shard_batch on the group"))
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f)


# ---- compiles ----------------------------------------------------------------------------------

def compiles_part() -> dict:
    from ulysses import flex

    stats = {}
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import counters

        stats = {k: int(v) for k, v in counters["stats"].items()}
    graphs = stats.get("unique_graphs", 0)
    row = {"unique_graphs": graphs, "flex_compiled_calls": flex.compile_stats["calls"],
           "flex_block_masks": flex.compile_stats["block_masks"],
           "recompile_limit": int(torch._dynamo.config.recompile_limit) if "torch._dynamo" in sys.modules else None}
    return {"rows": [row]}


# ---- main --------------------------------------------------------------------------------------

def summary_lines(results: dict) -> list[str]:
    lines = []
    for part, r in results.items():
        head = f"{part}: {'ok' if r.get('ok') else 'FAILED'} ({r.get('seconds', 0):.1f} s)"
        if "skipped" in r:
            head = f"{part}: skipped ({r['skipped']})"
        lines.append(head + (f" {r['error']}" if "error" in r else ""))
        for row in r.get("rows", []):
            shown = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items() if k not in ("trace",)}
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="small sizes only (the CI run)")
    p.add_argument("--out", default=os.environ.get("OUT", "build/gpu_check"))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --device cpu)")
        return 1
    os.makedirs(args.out, exist_ok=True)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"gpu_check: {name}, torch {torch.__version__}, device {device}{' (quick)' if args.quick else ''}",
          flush=True)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        parts = {
            "host_sync": lambda: host_sync_part(device, tmp),
            "local": lambda: local_part(device, args.quick),
            "sweep": lambda: sweep_part(device, tmp),
            "checkpoint": lambda: checkpoint_part(device, args.quick),
            "layer": lambda: layer_part(device, args.quick, tmp),
            "device_group": lambda: device_group_part(device, tmp),
            "compiles": compiles_part,
        }
        for part, fn in parts.items():
            results[part] = guarded(fn)
            if "skipped" in results[part]:
                results[part]["ok"] = True
            print("\n".join(summary_lines({part: results[part]})), flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "quick": args.quick, "parts": results}, f, indent=1)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write("\n".join(summary_lines(results)) + "\n")
    failed = [part for part, r in results.items() if not r.get("ok")]
    print(f"gpu_check: {'every part passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"(results in {args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
