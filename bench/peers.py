"""ulysses side by side with its peers on identical inputs over the same Gloo world:
DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` and yunchang's
``LongContextAttention`` (torch attention); the peers attend locally with SDPA, ulysses with
its fused CPU kernel.

    python bench/peers.py [--nproc 4] [--json FILE]

Peers are optional extras (``DS_BUILD_OPS=0 pip install --no-build-isolation '.[peers]'``);
a peer that is not installed is reported as such. Prints, and writes as JSON:

1. a correctness matrix against a single-rank float64 reference (forward output and q/k/v
   gradients), each case on a fresh process group with a 20 s timeout: exact / error / silently
   wrong / hang;
2. time of the all-to-all chain and of the attention layer forward+backward per system, as
   ratios to ulysses (slowest rank, median), every system in one world on the same inputs and
   timed in turns, so that the machine's drift falls on all alike; and peak memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

TIMEOUT = datetime.timedelta(seconds=20)


# ---- Systems: each builds a layer (q, k, v [B, S_r, H, D], the whole [B, S] key mask or None)
# -> [B, S_r, Hq, D]. A user holds the whole attention mask; each system takes it its own way.

def local_sdpa(q, k, v, key_mask=None, causal=False):
    """SDPA on [B, S, H, D] tensors with GQA by repeating kv heads; key_mask [B, S] bool."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = None
    if key_mask is not None:
        mask = key_mask[:, None, None, :]
        if causal:
            mask = mask & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    return out.transpose(1, 2)


def make_ulysses(group, causal):
    import ulysses

    attn = ulysses.DistributedAttention(group, causal=causal, timeout=TIMEOUT)

    def layer(q, k, v, key_mask=None):
        return attn(q, k, v, mask=None if key_mask is None else key_mask[:, None, None, :])

    return layer


def make_deepspeed(group, causal):
    """DeepSpeed's DistributedAttention as its users set it up: the sequence-parallel mesh
    registered as ``deepspeed.initialize(mesh_param=(dp, sp))`` registers it (its uneven-heads
    path reads this rank's SP rank from it), the mesh's SP group given to the layer, and the mask
    passed by keyword to the local attention (positional arguments after the batch dim are its
    rotary embeddings)."""
    import deepspeed
    import deepspeed.comm as ds_dist
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the torch.distributed world
    sp = dist.get_world_size(group)
    groups.mesh_device = ds_dist.initialize_mesh_device((dist.get_world_size() // sp, sp),
                                                        ("data_parallel", "sequence_parallel"))

    def local(q, k, v, key_mask=None):
        return local_sdpa(q, k, v, key_mask, causal)

    attn = DistributedAttention(local, groups._get_sequence_parallel_group(), scatter_idx=2, gather_idx=1)

    def layer(q, k, v, key_mask=None):
        return attn(q, k, v, 0) if key_mask is None else attn(q, k, v, 0, key_mask=key_mask)

    return layer


def make_yunchang(group, causal):
    # yunchang's Ulysses all-to-all (SeqAllToAll4D) around SDPA: its own torch attention types
    # have no backward on CPU ("Not implemented backward for PyTorch attention types").
    from yunchang.comm.all_to_all import SeqAllToAll4D

    def layer(q, k, v, key_mask=None):
        if key_mask is not None:
            raise NotImplementedError("yunchang's Ulysses attention takes no attention mask")
        q, k, v = (SeqAllToAll4D.apply(group, t, 2, 1, False) for t in (q, k, v))
        return SeqAllToAll4D.apply(group, local_sdpa(q, k, v, None, causal), 1, 2, False)

    return layer


SYSTEMS = {"ulysses": make_ulysses, "deepspeed": make_deepspeed, "yunchang": make_yunchang}


def a2a_chain(system, group, q, k, v):
    """The forward all-to-alls around attention alone: q, k, v to head sharding, and q's shape
    back to sequence sharding (as o would travel)."""
    if system == "ulysses":
        import ulysses

        lens = [q.shape[1]] * dist.get_world_size(group)
        qh, kh, vh = ulysses.scatter_heads([q, k, v], ["q", "kv", "kv"], q.shape[2], k.shape[2], lens,
                                           group=group)
        return ulysses.gather_heads([qh], ["q"], q.shape[2], k.shape[2], lens, group=group)[0]
    if system == "deepspeed":
        from deepspeed.sequence.layer import _SeqAllToAll

        qh, kh, vh = (_SeqAllToAll.apply(group, t, 2, 1, 0, None, None, "x", True, k.shape[2])
                      for t in (q, k, v))
        return _SeqAllToAll.apply(group, qh, 1, 2, 0, None, None, "x", True, k.shape[2])
    from yunchang.comm.all_to_all import SeqAllToAll4D

    qh, kh, vh = (SeqAllToAll4D.apply(group, t, 2, 1, False) for t in (q, k, v))
    return SeqAllToAll4D.apply(group, qh, 1, 2, False)


def available(name: str, module: str | None = None) -> str:
    try:
        __import__(module or {"ulysses": "ulysses", "deepspeed": "deepspeed.sequence.layer",
                              "yunchang": "yunchang"}[name])
        return ""
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"not installed ({type(e).__name__})"


# ---- Correctness matrix.

CASES = [
    # name, S, Hq, Hkv, padding, causal
    ("even heads", 16, 8, 8, False, True),
    ("uneven heads (15)", 16, 15, 15, False, True),
    ("GQA 8/2 (Hkv < P)", 16, 8, 2, False, True),
    ("S not divisible by P", 18, 8, 8, False, True),
    ("padding mask", 16, 8, 8, True, True),
]


def shard_lens(S, P):
    return [S // P + (r < S % P) for r in range(P)]


def reference(q, k, v, key_mask, causal):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = local_sdpa(q, k, v, key_mask, causal)
    if key_mask is not None:  # rows with no allowed key are 0 in every system
        out = out.nan_to_num(0.0)
    return out, q, k, v


def run_case(system, case, P, rank):
    name, S, hq, hkv, padding, causal = case
    gen = torch.Generator().manual_seed(11)
    B, D = 2, 8
    Q, K, V = (torch.randn(B, S, h, D, generator=gen) for h in (hq, hkv, hkv))
    dO = torch.randn(B, S, hq, D, generator=gen)
    key_mask = None
    if padding:
        key_mask = torch.ones(B, S, dtype=torch.bool)
        key_mask[1, :5] = False  # left padding on row 1
    ref, rq, rk, rv = reference(Q, K, V, key_mask, causal)
    (ref * dO.double()).sum().backward()
    lens = shard_lens(S, P)
    lo, n = sum(lens[:rank]), lens[rank]
    group = dist.new_group(list(range(P)), timeout=TIMEOUT)
    try:
        layer = SYSTEMS[system](group, causal)
        q, k, v = (t[:, lo:lo + n].clone().requires_grad_() for t in (Q, K, V))
        out = layer(q, k, v, key_mask)
        (out * dO[:, lo:lo + n]).sum().backward()
        errors = [(out - ref[:, lo:lo + n]).abs().max() / ref.abs().max()]
        for got, want in ((q.grad, rq.grad), (k.grad, rk.grad), (v.grad, rv.grad)):
            errors.append((got - want[:, lo:lo + n]).abs().max() / want.abs().max())
        err = max(e.item() for e in errors)
        return ("exact" if err < 1e-4 else "silently wrong", f"max rel. error {err:.1e}")
    except Exception as e:  # noqa: BLE001 - the outcome being measured
        text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:110]
        hang = "timed out" in text.lower() or "timeout" in text.lower()
        return ("hang" if hang else "error", text)


def run_two_models(system, P, rank):
    """Two attention instances with different head counts (8/4, then 12/12, then 8/4 again) in
    one process: the second must not change how the first shards."""
    results = []
    for case in (("m1", 16, 8, 4, False, True), ("m2", 16, 12, 12, False, True), ("m1", 16, 8, 4, False, True)):
        results.append(run_case(system, case, P, rank))
    worst = next((r for r in results if r[0] != "exact"), results[0])
    return worst


# ---- Timing.

def alternated(fns, group, repeats):
    """Median ms (slowest rank) of each of ``fns`` (already warmed up), timed in turns: repeat r
    runs them in an order rotated by r, so that a drift in the machine's speed falls on all alike."""
    names = list(fns)
    samples = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            dist.barrier(group)
            t0 = time.perf_counter()
            fns[name]()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            samples[name].append(t.item() * 1e3)
    return {name: statistics.median(x) for name, x in samples.items()}


def measure_times(systems, P, rank, S, hq, hkv, repeats):
    """Every system's layer in one world on the same inputs: the peak RSS one step adds, then
    layer and all-to-all times, alternated (see alternated)."""
    group = dist.new_group(list(range(P)), timeout=TIMEOUT)
    gen = torch.Generator().manual_seed(rank)
    n = S // P
    q, k, v = (torch.randn(1, n, h, 64, generator=gen) for h in (hq, hkv, hkv))

    def rss(key: str) -> int:
        with open("/proc/self/status") as status:
            return int(next(line.split()[1] for line in status if line.startswith(key)))

    results, steps = {}, {}
    for system in systems:
        layer = SYSTEMS[system](group, True)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]

        def step(layer=layer, inputs=inputs):
            for t in inputs:
                t.grad = None
            layer(*inputs).sum().backward()

        try:
            step()  # warm-up (a system that cannot run the case says so here, alike on every rank)
        except Exception as e:  # noqa: BLE001 - reported as the system's outcome
            results[system] = {"error": f"error: {type(e).__name__}: {str(e).splitlines()[0][:100]}"}
            continue
        with open("/proc/self/clear_refs", "w") as f:  # the high-water mark reset first
            f.write("5")
        before = rss("VmRSS:")
        step()
        peak = torch.tensor([rss("VmHWM:") - before], dtype=torch.long)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        results[system] = {"peak_mb": int(peak.item()) // 1024}
        steps[system] = step
    layer_ms = alternated(steps, group, repeats)
    with torch.no_grad():
        chains = {s: (lambda s=s: a2a_chain(s, group, q, k, v)) for s in steps}
        for chain in chains.values():
            chain()  # warm-up
        a2a_ms = alternated(chains, group, repeats)
    for system in steps:
        results[system].update(layer_ms=layer_ms[system], a2a_ms=a2a_ms[system])
    return results


# ---- AutoSP: an unmodified single-device model compiled sequence-parallel.

AUTOSP_SYSTEMS = {"ulysses": "ulysses", "deepspeed": "deepspeed.compile.passes.sp_compile"}
AUTOSP_CASES = [
    # name, model, S, padding
    ("plain GQA 8/2, causal", "plain", 16, False),
    ("plain GQA 8/2, padding mask", "plain", 16, True),
    ("Llama, S even", "llama", 16, False),
    ("Llama, S even, padding", "llama", 16, True),  # The one setup DeepSpeed's AutoSP runs in.
    ("Llama, S uneven, padding", "llama", 13, True),
]


def autosp_case(system, case, P):
    """Loss and gradient errors of the compiled sequence-parallel step against the same model
    run eagerly on one rank (gradients summed over the group)."""
    name, kind, S, padding = case
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (2, S), generator=gen)
    attention_mask = torch.ones(2, S, dtype=torch.long)
    if padding:
        attention_mask[0, :3] = 0
    torch.manual_seed(0)
    if kind == "plain":
        from autosp_train import PlainGQA

        model = PlainGQA(vocab=32, dim=64, hq=8, hkv=2)
        inputs = {"input_ids": ids, "labels": ids.roll(-1, 1).masked_fill(attention_mask == 0, -100)}
        loss_of = lambda out: out  # noqa: E731
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=8, use_cache=False)
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").float()
        inputs = {"input_ids": ids, "labels": ids.masked_fill(attention_mask == 0, -100),
                  "position_ids": torch.arange(S).expand(2, S).clone()}
        loss_of = lambda out: out.loss  # noqa: E731
    if padding:
        inputs["attention_mask"] = attention_mask
    ref = loss_of(model(**inputs))
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    inputs = {k: v.clone() for k, v in inputs.items()}
    if system == "ulysses":
        import ulysses

        backend = ulysses.autosp(timeout=TIMEOUT)
        ulysses.mark_sequence(inputs["input_ids"])
    else:
        import deepspeed
        from deepspeed.compile.passes.sp_compile import apply_autosp, prepare_autosp_inputs

        deepspeed.init_distributed(dist_backend="gloo")

        def backend(gm, example_inputs):
            apply_autosp(gm, example_inputs, sp_size=P, dp_size=1)
            return gm.forward

        prepare_autosp_inputs(inputs["input_ids"], inputs["labels"], inputs.get("position_ids"),
                              inputs.get("attention_mask"))
    loss = loss_of(torch.compile(model, backend=backend, fullgraph=True)(**inputs))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
    grad_err = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
                   for a, b in zip(ref_grads, grads))
    return {"loss_err": abs(loss.item() - ref.item()) / abs(ref.item()), "grad_err": grad_err}


def autosp_outcome(result) -> tuple[str, str]:
    if not isinstance(result, dict):
        return result[0], result[1]
    worst = max(result["loss_err"], result["grad_err"])
    detail = f"loss rel. error {result['loss_err']:.1e}, gradients {result['grad_err']:.1e}"
    return ("exact" if worst <= 1e-4 else "silently wrong"), detail


# ---- Driver: every case in a fresh world of processes, so a crash or hang is an outcome.

def worker(rank, P, store_dir, task, args, out_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=P,
                            timeout=TIMEOUT)
    kind, system, case = task
    if kind == "case":
        result = run_two_models(system, P, rank) if case[1] == 0 else run_case(system, case, P, rank)
    elif kind == "autosp":
        result = autosp_case(system, case, P)
    else:  # "time": `system` is the list of systems, timed together
        S, hq, hkv = case
        result = measure_times(system, P, rank, S, hq, hkv, args.repeats)
    with open(os.path.join(out_dir, str(rank)), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run_world(P, task, args, limit_s=90):
    """Runs `task` on P fresh processes; returns rank 0's result, or ("crash"/"hang", detail)."""
    import glob

    import torch.multiprocessing as mp

    # One world runs at a time, so a JIT-build lock left by a killed world (DeepSpeed builds its
    # CPU comm op through torch.utils.cpp_extension at init) is stale: without this every later
    # DeepSpeed world waits on it forever.
    for lock in glob.glob(os.path.expanduser("~/.cache/torch_extensions/*/*/lock")):
        os.remove(lock)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(worker, args=(P, tmp, task, args, tmp), nprocs=P, start_method="spawn",
                                 join=False)
        deadline = time.monotonic() + limit_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    return ("hang", f"no result after {limit_s} s")
        except mp.ProcessExitedException as e:
            for proc in ctx.processes:
                proc.kill()
            return ("crash", str(e).splitlines()[0][:110])
        except mp.ProcessRaisedException as e:
            lines = str(e).strip().splitlines()
            errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
            last = (errors or lines)[-1][:110]
            return ("hang" if "timed out" in last.lower() else "error", last)
        with open(os.path.join(tmp, "0")) as f:
            return json.load(f)


def print_matrix(title: str, rows: list[dict]) -> None:
    print(title)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["system"], r["case"]): r for r in rows}
    width = max(len(c) for c in cases) + 2
    print(("case".ljust(width) + "".join(s.ljust(18) for s in systems)).rstrip())
    for c in cases:
        print((c.ljust(width) + "".join(cell[(s, c)]["outcome"].ljust(18) for s in systems)).rstrip())
    print("\ndetails:")
    for r in rows:
        if r["outcome"] != "exact":
            print(f"  {r['system']:10s} {r['case']:28s} {r['detail']}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--seq-lens", default="",
                   help="comma-separated sequence lengths to time (default: --seq-len)")
    p.add_argument("--heads", default="8/8,8/2",
                   help="comma-separated query/kv head counts to time, e.g. 16/16,16/4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="")
    p.add_argument("--parts", default="matrix,autosp,timing",
                   help="comma-separated parts to run (matrix, autosp, timing)")
    args = p.parse_args()
    P = args.nproc
    parts = set(args.parts.split(","))
    rows, timing, autosp_rows = [], [], []
    for system in SYSTEMS if "matrix" in parts else ():
        missing = available(system)
        for case in CASES + [("two models, different heads", 0, 0, 0, False, True)]:
            outcome = ("not run", missing) if missing else run_world(P, ("case", system, case), args)
            rows.append({"system": system, "case": case[0], "outcome": outcome[0], "detail": outcome[1]})
            print(f"  {system:10s} {case[0]:28s} {outcome[0]}", flush=True)
    for system, module in AUTOSP_SYSTEMS.items() if "autosp" in parts else ():
        missing = available(system, module)
        for case in AUTOSP_CASES:
            r = ("not run", missing) if missing else run_world(P, ("autosp", system, case), args, limit_s=180)
            outcome, detail = autosp_outcome(r)
            autosp_rows.append({"system": system, "case": case[0], "outcome": outcome, "detail": detail})
            print(f"  autosp {system:10s} {case[0]:28s} {outcome}", flush=True)
    seq_lens = [int(x) for x in args.seq_lens.split(",")] if args.seq_lens else [args.seq_len]
    heads = [tuple(int(n) for n in h.split("/")) for h in args.heads.split(",")]
    shapes = [(S, hq, hkv) for S in seq_lens for hq, hkv in heads]
    present = [system for system in SYSTEMS if not available(system)]
    for S, hq, hkv in shapes if "timing" in parts else ():
        r = run_world(P, ("time", present, (S, hq, hkv)), args, limit_s=3600)
        for system in present:
            entry = {"system": system, "seq_len": S, "q_heads": hq, "kv_heads": hkv}
            entry.update(r[system] if isinstance(r, dict) else {"error": f"{r[0]}: {r[1]}"})
            timing.append(entry)
    result = {"nproc": P, "matrix": rows, "autosp_matrix": autosp_rows, "timing": timing}
    if rows:
        print_matrix(f"correctness vs a single-rank float64 reference, P={P}, fp32, forward and "
                     "q/k/v gradients", rows)
    if autosp_rows:
        print_matrix(f"\nAutoSP: an unmodified model compiled sequence-parallel, P={P}, fp32, loss "
                     "and every gradient vs the same model run eagerly on one rank", autosp_rows)
    if timing:
        print(f"\ntime, B=1, D=64, fp32, slowest rank, median of {args.repeats} timed in turns in one world; "
              f"x = system / ulysses. a2a: the forward all-to-alls alone (q, k, v in; o out). layer: attention "
              f"forward+backward, causal; peak: RSS one layer step adds")
        base = {(t["seq_len"], t["q_heads"], t["kv_heads"]): t for t in result["timing"]
                if t["system"] == "ulysses" and "layer_ms" in t}
        for t in result["timing"]:
            key = (t["seq_len"], t["q_heads"], t["kv_heads"])
            if "layer_ms" in t:
                b = base.get(key, {})
                xa = t["a2a_ms"] / b["a2a_ms"] if b else float("nan")
                xl = t["layer_ms"] / b["layer_ms"] if b else float("nan")
                print(f"  S={t['seq_len']} Hq={t['q_heads']} Hkv={t['kv_heads']} {t['system']:10s} "
                      f"a2a {t['a2a_ms']:7.1f} ms x{xa:5.2f}   layer {t['layer_ms']:7.1f} ms x{xl:5.2f}   "
                      f"peak +{t['peak_mb']} MB")
            else:
                print(f"  S={t['seq_len']} Hq={t['q_heads']} Hkv={t['kv_heads']} {t['system']:10s} {t['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
