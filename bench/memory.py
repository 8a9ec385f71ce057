"""Per-rank peak memory and step time of a Llama-shaped model at long sequences, with each of
ulysses' long-sequence features (``ulysses.tiled`` through ``ulysses.hf.sequence_parallel``)
alone and together, and DeepSpeed ALST's ``TiledMLP`` + ``TiledFusedLogitsLoss`` applied to
the same model (ulysses attention under both) when DeepSpeed is installed.

    python bench/memory.py [--seq-lens 4096,8192] [--sp 1,2,4] [--features none,all,...]
                           [--vocab 32000] [--json FILE] [--plot FILE]
    python bench/memory.py --fsdp [--seq-lens 2048] [--sp 2,4] [--vocab 128000] [--layers 8]

``--attention`` measures one attention layer instead (``DistributedAttention``, Llama-8B's 32
query and 8 kv heads of 128, causal, float32), two forward and backward passes from before its
first call, for each ``--head-chunks`` count: ``peak_MiB`` is the high-water mark above the
layer's inputs (the group's buffer cache included: it keeps what the exchanges freed for the next
step), ``outputs_MiB`` what the layer must hand back (o and the gradients of q, k and v),
``saved_MiB`` what the kernel keeps for backward (q, k, v and o by heads over the whole sequence,
every chunk's, from the head plan), and ``transient_MiB`` = peak - outputs - saved: what running
the layer costs beyond both (exchange buffers, whole-sequence copies, gradients by heads).
A count with an ``r`` after it (``4r``) also recomputes the chunks (``recompute_chunks``): the
kernel then keeps nothing by heads (``saved_MiB`` 0), and ``held_MiB`` = peak - outputs is what
the layer holds beyond what it hands back, saved tensors included, comparable across the rows.
``--head-chunks alst`` adds DeepSpeed ALST's attention layer to that table (0.19.8, an optional
extra: ``UlyssesSPAttentionHF`` around transformers' SDPA attention, as ALST installs it in a
model). ``--head-chunks`` also applies to the model rows (``sequence_parallel(head_chunks=k)``;
give ``--heads 32,8`` there for a model with enough kv heads).

``--family qwen3_next|bamba|lfm2`` measures a hybrid instead of Llama: a linear-time mixer
(gated delta-net, Mamba-2, short convolution; ``ulysses.hybrid``) in every other layer.

``--fsdp`` compares how the parameters are held instead, with an AdamW step: ``ddp`` (every rank
holds the whole model, its gradients and both Adam moments; gradients summed over the group)
against ``fsdp2`` (``fully_shard`` on every decoder layer and the root, over every rank: each
holds 1/P). ``state_MiB`` is this rank's parameters + gradients + optimizer state after the step
(the local shards under FSDP2), ``peak_MiB`` what the step adds at its peak, as below.

Each (S, P, features) runs in fresh processes, one per rank (torch.multiprocessing, Gloo on
loopback): a training step (forward, loss, backward, gradient sum) on one sequence of S random
tokens, started as a Trainer starts one: gradients set to None, so backward makes them anew.
Memory is the rank's resident-set high-water mark during the step minus its resident set before
it (the model built, no gradients): everything the step adds, the gradients it makes included
(``grad_MiB``, the model's gradient bytes, all of which exist at the step's end). glibc's mmap
threshold is fixed at 1 MiB, so freed tensors leave the resident set. On CPU there is no
allocator statistic to add; every rank shares this machine's
cores, so times are the slowest rank's. Features:

- ``none``: untiled, nothing checkpointed;  ``mlp`` / ``loss``: the tiled MLP / tiled logits + loss;
- ``tiled``: both;  ``recompute`` / ``offload``: checkpointed layers (offload: inputs on the host);
- ``tiled+recompute``, ``all`` (= tiled + offload);
- ``ds``: DeepSpeed's TiledMLP + TiledFusedLogitsLoss as its docstrings apply them;
  ``ds+recompute``: those with transformers' checkpointing (DeepSpeed's own offload needs its
  engine and a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FEATURES = {
    "none": {}, "mlp": {"tiled_mlp": True}, "loss": {"tiled_loss": True},
    "tiled": {"tiled_mlp": True, "tiled_loss": True}, "recompute": {"checkpoint": "recompute"},
    "offload": {"checkpoint": "offload"},
    "tiled+recompute": {"tiled_mlp": True, "tiled_loss": True, "checkpoint": "recompute"},
    "all": {"tiled_mlp": True, "tiled_loss": True, "checkpoint": "offload"},
    "ds": {}, "ds+recompute": {},
}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current
        f.write("5")


def _config(family: str, vocab: int, layers: int, heads: tuple[int, int]):
    """The benchmark's model, hidden size 512: Llama, or a hybrid whose every other layer is a
    linear-time mixer (Qwen3-Next's gated delta-net, 8 value heads over 4 key heads of 64; Bamba's
    Mamba-2, 16 heads of 32 over one B/C group; LFM2's short convolution)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                  num_attention_heads=heads[0], num_key_value_heads=heads[1], max_position_embeddings=1 << 17,
                  tie_word_embeddings=False)
    mixed = ["linear_attention", "full_attention"] * (layers // 2) + ["linear_attention"] * (layers % 2)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(head_dim=512 // heads[0], layer_types=mixed,
                                            mlp_only_layers=list(range(layers)), linear_num_value_heads=8,
                                            linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                                            **common)
    if family == "bamba":
        return transformers.BambaConfig(attn_layer_indices=list(range(1, layers, 2)), mamba_n_heads=16,
                                        mamba_d_head=32, mamba_n_groups=1, mamba_d_state=64, mamba_expand=1,
                                        mamba_chunk_size=256, **common)
    if family == "lfm2":
        return transformers.Lfm2Config(layer_types=[t.replace("linear_attention", "conv") for t in mixed], **common)
    return transformers.LlamaConfig(head_dim=512 // heads[0], attention_dropout=0.0, **common)


def _model(vocab: int, layers: int, heads: tuple[int, int] = (8, 2), family: str = "llama"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(family, vocab, layers, heads)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().train()


def _deepspeed_tiling(model, group):
    """DeepSpeed's TiledMLP on every decoder MLP as its docstring applies it (shards =
    ceil(seqlen / hidden), agreed by an all-reduce MAX), and a loss through its TiledFusedLogitsLoss."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    pg = dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group
    for layer in model.model.layers:
        mlp = layer.mlp

        def tiled_forward(x, mlp=mlp, forward=mlp.forward):
            shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]))
            dist.all_reduce(shards, op=dist.ReduceOp.MAX, group=pg)
            return TiledMLP.apply(lambda _, t: forward(t), mlp, x, int(shards), list(mlp.parameters()))

        mlp.forward = tiled_forward

    def loss(hidden, labels, shards):
        head = model.lm_head

        def fn(module, x, y):
            logits = module(x).float()
            return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1),
                                                     ignore_index=-100, reduction="sum")

        return TiledFusedLogitsLoss.apply(fn, head, hidden, labels, None, shards, [head.weight], "sum")

    return loss


def _local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors if t is not None)


def _state_bytes(model, optimizer) -> int:
    """This rank's parameters, gradients and optimizer state."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return _local_bytes(params) + _local_bytes(p.grad for p in params) + _local_bytes(state)


def _rank(rank: int, world: int, port: int, task: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    import ulysses.hf as uhf
    import ulysses.tiled as T

    if task.get("attention"):
        return _attention_rank(rank, task, out_dir)
    feature = task["features"]
    model = _model(task["vocab"], task["layers"], tuple(task.get("heads", (8, 2))), task.get("family", "llama"))
    if task.get("freeze_vocab"):  # the embedding and the head take no gradient: only activations grow with V
        for p in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            p.requires_grad_(False)
    group = dist.group.WORLD
    chunks, recompute = chunk_spec(task.get("head_chunks", 1))
    uhf.sequence_parallel(model, group, **FEATURES[feature], head_chunks=chunks, recompute_chunks=recompute)
    holding = task.get("holding")  # --fsdp: "ddp" or "fsdp2", with an AdamW step
    if holding == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model, reshard_after_forward=False)  # the root: backward needs it at once
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if holding else None
    ds_loss = _deepspeed_tiling(model, group) if feature.startswith("ds") else None
    if feature == "ds+recompute":
        model.activation_checkpointing_enable()  # transformers' (torch's) checkpoint
    gen = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, task["vocab"], (1, task["seq_len"]), generator=gen)}
    shard = uhf.shard_batch(batch, group)
    inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"],
              "ulysses_seq_lens": shard["seq_lens"]}
    labels = shard["shift_labels"]

    def step() -> float:
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)  # as a Trainer does: backward makes the gradients anew
        if ds_loss is not None:
            hidden = model.model(**inputs).last_hidden_state
            rows = max(1, uhf.LOSS_TILE_BYTES // (4 * task["vocab"]))  # our tile size, for a like comparison
            token_sum = ds_loss(hidden, labels, T.tile_count(max(shard["seq_lens"]), rows))
            loss, _ = uhf.token_mean(token_sum, labels, group)
        elif FEATURES[feature].get("tiled_loss"):
            loss, _ = uhf.token_mean(model(**inputs, ulysses_shift_labels=labels).loss, labels, group)
        else:
            # FSDP2 averages gradients over the group; the plain loop sums them.
            gradients = "averaged" if holding == "fsdp2" else "summed"
            loss, _ = uhf.sequence_parallel_loss(model(**inputs).logits, labels, group, gradients=gradients)
        loss.backward()
        if holding != "fsdp2":
            uhf.all_reduce_gradients(model, group)
        if optimizer is not None:
            optimizer.step()
        dist.barrier()
        return time.perf_counter() - start

    step_times = []
    baseline = None
    for i in range(task["steps"]):
        if i == task["steps"] - 1:  # measure the last step (the first one warms up at short S)
            model.zero_grad(set_to_none=True)  # the step starts without gradients (its own call is then a no-op)
            dist.barrier()
            baseline = _status_kib("VmRSS")
            _reset_peak()
        step_times.append(step())
    peak = _status_kib("VmHWM")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_mib": (peak - baseline) / 1024, "step_s": step_times[-1],
                   "grad_mib": _local_bytes(p.grad for p in model.parameters()) / 2**20,
                   "state_mib": _state_bytes(model, optimizer) / 2**20 if optimizer else 0.0,
                   "host_mib": T.live_host_bytes() / 2**20}, f)
    dist.destroy_process_group()


def chunk_spec(spec: object) -> tuple[object, bool]:
    """A ``--head-chunks`` entry as (head_chunks, recompute_chunks): ``4``, ``"auto"``, or with
    an ``r`` after it (``"4r"``) recomputed; other names ("alst") as given."""
    text = str(spec)
    recompute = text.endswith("r") and text != "r"
    text = text[:-1] if recompute else text
    return (int(text) if text.isdigit() else text), recompute


def _attention_rank(rank: int, task: dict, out_dir: str) -> None:
    """--attention: one DistributedAttention layer's forward and backward on this rank's shard."""
    import ulysses

    sp, S, chunks = task["sp"], task["seq_len"], task["head_chunks"]
    hq, hkv, D = 32, 8, 128
    lens = ulysses._C.sequence_split(S, sp)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, lens[rank], h, D, generator=gen).requires_grad_() for h in (hq, hkv, hkv))
    grad = torch.randn(1, lens[rank], hq, D, generator=gen)
    chunks, recompute = chunk_spec(chunks)
    if chunks == "alst":
        run = _alst_attention(rank, S, hq, hkv, D, lens[rank])
    else:
        attention = ulysses.DistributedAttention(dist.group.WORLD, q_heads=hq, kv_heads=hkv, causal=True,
                                                 head_chunks=chunks, recompute_chunks=recompute)

        def run(q, k, v):
            return attention(q, k, v, seq_lens=lens)

    def step() -> float:
        start = time.perf_counter()
        run(q, k, v).backward(grad)
        dist.barrier()
        return time.perf_counter() - start

    # From before the first call: the group's buffer cache keeps what the exchanges freed
    # (reused by the next step), so its high-water mark is part of what the layer costs.
    dist.barrier()
    baseline = _status_kib("VmRSS")
    _reset_peak()
    for _ in range(task["steps"] - 1):  # warm-up
        step()
        q.grad = k.grad = v.grad = None
    seconds = step()
    peak = _status_kib("VmHWM")
    outputs = 2 * q.nbytes + k.nbytes + v.nbytes  # o is q-shaped
    saved = 0  # q, k, v and o by heads, each chunk's (this rank's heads in its plan) x S x D
    count = 1 if chunks == "alst" else ulysses.attention.chunk_count(chunks, hq, hkv, sp, recompute)
    for (qb, qe), (kb, ke) in [] if recompute else ulysses._C.head_chunks(hq, hkv, sp, count):
        plan = ulysses._C.plan(qe - qb, ke - kb, sp)
        saved += (2 * plan["q_heads"][rank] + 2 * plan["kv_heads"][rank]) * S * D * q.element_size()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_mib": (peak - baseline) / 1024, "outputs_mib": outputs / 2**20, "saved_mib": saved / 2**20,
                   "step_s": seconds, "grad_mib": 0.0, "state_mib": 0.0}, f)
    dist.destroy_process_group()


def _alst_attention(rank: int, S: int, hq: int, hkv: int, D: int, rows: int):
    """DeepSpeed ALST's attention layer as it runs inside a Hugging Face model: its
    ``UlyssesSPAttentionHF`` around transformers' SDPA attention (what ``register_with_transformers``
    installs for "sdpa"), on [B, S_r, H, D] inputs like ours. Its saved tensors are the kernel's
    q, k, v and o by heads, as ours at k = 1."""
    from types import SimpleNamespace

    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the torch.distributed world
    layer = UlyssesSPAttentionHF(attn=sdpa_attention_forward, batch_size=1, attn_head_count=hq, attn_head_size=D,
                                 kv_head_count=hkv, num_hidden_layers=1, process_group=dist.group.WORLD,
                                 seq_length_is_variable=True)
    layer.core_attn_implementation = "sdpa"
    module = SimpleNamespace(training=True, is_causal=True, num_key_value_groups=hq // hkv)
    positions = torch.arange(rank * rows, (rank + 1) * rows)[None]

    def run(q, k, v):
        out = layer(module, *(t.transpose(1, 2) for t in (q, k, v)), None, position_ids=positions)
        return out[0].reshape(1, rows, hq, D)  # (context, attention weights)

    return run


def compare_chunks(a: argparse.Namespace, rows: list[dict]) -> int:
    """--attention: each (S, P) at every chunk count, side by side with k = 1."""
    print(f"{'S':>6} {'P':>2} {'chunks':>6} {'peak_MiB':>9} {'outputs_MiB':>11} {'saved_MiB':>9} "
          f"{'transient_MiB':>13} {'held_MiB':>8} {'step_s':>7} {'peak_over_k1':>12} {'transient_over_k1':>17} "
          f"{'held_over_k1':>12} {'step_over_k1':>12}", flush=True)
    for seq_len in map(int, a.seq_lens.split(",")):
        for sp in map(int, a.sp.split(",")):
            first = None
            for chunks in a.head_chunks:
                row = measure(dict(seq_len=seq_len, sp=sp, head_chunks=chunks, attention=True, steps=a.steps or 2))
                row["transient_mib"] = row["peak_mib"] - row["outputs_mib"] - row["saved_mib"]
                row["held_mib"] = row["peak_mib"] - row["outputs_mib"]
                first = first or row
                for key in ("peak", "transient", "held", "step"):
                    unit = "s" if key == "step" else "mib"
                    row[f"{key}_over_k1"] = row[f"{key}_{unit}"] / first[f"{key}_{unit}"]
                # A rerun replaces its row in --json's file (as the model rows do), not adds to it.
                same = ("seq_len", "sp", "head_chunks", "attention")
                rows[:] = [r for r in rows if any(r.get(k) != row[k] for k in same)] + [row]
                print(f"{seq_len:>6} {sp:>2} {chunks:>6} {row['peak_mib']:>9.1f} {row['outputs_mib']:>11.1f} "
                      f"{row['saved_mib']:>9.1f} {row['transient_mib']:>13.1f} {row['held_mib']:>8.1f} "
                      f"{row['step_s']:>7.2f} {row['peak_over_k1']:>12.3f} {row['transient_over_k1']:>17.3f} "
                      f"{row['held_over_k1']:>12.3f} {row['step_over_k1']:>12.3f}",
                      flush=True)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump(rows, f, indent=1)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(rank_fn, task: dict) -> list[dict]:
    """``rank_fn(rank, world, port, task, out_dir)`` in ``task["sp"]`` fresh processes (spawned, Gloo
    on loopback); returns what each rank wrote to ``out_dir/rank{r}.json``."""
    # glibc keeps freed blocks below its (self-raising, up to 32 MiB) mmap threshold resident: a
    # first step would then leave the second's memory in the baseline. A fixed 1 MiB threshold
    # maps every large tensor on its own, so the resident set follows the live tensors.
    os.environ.update(MALLOC_MMAP_THRESHOLD_=str(1 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 20))
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_fn, args=(task["sp"], _free_port(), task, out), nprocs=task["sp"],
                           start_method="spawn", join=True)
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(task["sp"])]


def measure(task: dict) -> dict:
    ranks = spawn_ranks(_rank, task)
    return {**task, "peak_mib": max(r["peak_mib"] for r in ranks), "step_s": max(r["step_s"] for r in ranks),
            "outputs_mib": max(r.get("outputs_mib", 0.0) for r in ranks),
            "saved_mib": max(r.get("saved_mib", 0.0) for r in ranks),
            "grad_mib": ranks[0]["grad_mib"], "state_mib": max(r["state_mib"] for r in ranks)}


def _have_deepspeed() -> bool:
    try:
        import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means: not available
        print(f"memory: DeepSpeed is not available ({type(e).__name__}: {e}); its rows are skipped", flush=True)
        return False
    return True


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sps = sorted({r["sp"] for r in rows})
    fig, axes = plt.subplots(1, len(sps), figsize=(5 * len(sps), 4), sharey=True, squeeze=False)
    for ax, sp in zip(axes[0], sps):
        for feature in FEATURES:
            pts = sorted((r["seq_len"], r["peak_mib"]) for r in rows
                         if r["sp"] == sp and r["features"] == feature and r["vocab"] == rows[0]["vocab"]
                         and not r.get("freeze_vocab"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=feature)
        ax.set(title=f"P = {sp}: per-rank peak memory of a step", xlabel="sequence length S", ylabel="MiB",
               xscale="log", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare_holdings(a: argparse.Namespace, rows: list[dict]) -> int:
    """--fsdp: each P with the model replicated (ddp) and sharded (fsdp2), side by side."""
    print(f"{'S':>6} {'P':>2} {'vocab':>6} {'holding':<7} {'state_MiB':>10} {'peak_MiB':>9} {'step_s':>8} "
          f"{'state_over_ddp_per_rank':>24} {'step_over_ddp':>14}", flush=True)
    for vocab in map(int, a.vocab.split(",")):
        for seq_len in map(int, a.seq_lens.split(",")):
            for sp in map(int, a.sp.split(",")):
                ddp = None
                for holding in ("ddp", "fsdp2"):
                    task = dict(seq_len=seq_len, sp=sp, vocab=vocab, features="none", layers=a.layers,
                                steps=a.steps or 2, holding=holding)
                    row = measure(task)
                    ddp = ddp or row
                    row["state_over_ddp_per_rank"] = row["state_mib"] / (ddp["state_mib"] / sp)
                    row["step_over_ddp"] = row["step_s"] / ddp["step_s"]
                    rows.append(row)
                    print(f"{seq_len:>6} {sp:>2} {vocab:>6} {holding:<7} {row['state_mib']:>10.1f} "
                          f"{row['peak_mib']:>9.1f} {row['step_s']:>8.2f} {row['state_over_ddp_per_rank']:>24.3f} "
                          f"{row['step_over_ddp']:>14.3f}", flush=True)
                    if a.json:
                        with open(a.json, "w") as f:
                            json.dump(rows, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="4096,8192,16384,32768")
    p.add_argument("--sp", default="1,2,4", help="SP group sizes")
    p.add_argument("--features", default=",".join(FEATURES), help=f"from {', '.join(FEATURES)}")
    p.add_argument("--vocab", default="32000", help="vocabulary sizes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--freeze-vocab", action="store_true",
                   help="the embedding and the head take no gradient (their [V, E] gradients then leave the peak)")
    p.add_argument("--steps", type=int, default=0, help="steps per run, the last measured (0: 2 below S = 16K, else 1)")
    p.add_argument("--fsdp", action="store_true",
                   help="DDP-style replicas against FSDP2 sharding, with an AdamW step (features: none)")
    p.add_argument("--attention", action="store_true",
                   help="one attention layer (fwd + bwd) at each --head-chunks count instead of a model step")
    p.add_argument("--head-chunks", default="1", help="head chunk counts (DistributedAttention(head_chunks=)); "
                   "'4r': 4 chunks with recompute_chunks; "
                   "with --attention, 'alst' for DeepSpeed ALST's attention layer (UlyssesSPAttentionHF)")
    p.add_argument("--heads", default="8,2", help="the model's query and kv heads (hidden size 512)")
    p.add_argument("--family", default="llama", choices=("llama", "qwen3_next", "bamba", "lfm2"),
                   help="the model: Llama, or a hybrid with a linear-time mixer in every other layer")
    p.add_argument("--json", default=None, help="append the rows to this JSON file (a list)")
    p.add_argument("--plot", default=None, help="plot peak memory vs S from the JSON file into this PNG")
    a = p.parse_args()
    a.head_chunks = [int(k) if k.isdigit() else k for k in a.head_chunks.split(",")]
    unknown = set(a.features.split(",")) - set(FEATURES)
    if unknown:
        p.error(f"unknown features {sorted(unknown)}; choose from {', '.join(FEATURES)}")
    rows: list[dict] = json.load(open(a.json)) if a.json and os.path.exists(a.json) else []
    if a.fsdp:
        return compare_holdings(a, rows)
    if a.attention:
        return compare_chunks(a, rows)
    heads = [int(h) for h in a.heads.split(",")]
    features = [f for f in a.features.split(",") if not f.startswith("ds") or _have_deepspeed()]
    chunk_counts = a.head_chunks
    show = chunk_counts != [1]  # the chunks column, when chunk counts are asked for

    def chunk_cell(value: object) -> str:
        return f" {value:>6}" if show else ""

    print(f"{'S':>6} {'P':>2} {'vocab':>6} {'features':<16}{chunk_cell('chunks')} {'peak_MiB':>9} {'grad_MiB':>9} "
          f"{'step_s':>8}", flush=True)
    for vocab in map(int, a.vocab.split(",")):
        for seq_len in map(int, a.seq_lens.split(",")):
            for sp in map(int, a.sp.split(",")):
                for feature in features:
                    for chunks in chunk_counts:
                        steps = a.steps or (2 if seq_len < 16384 else 1)
                        task = dict(seq_len=seq_len, sp=sp, vocab=vocab, features=feature, layers=a.layers,
                                    steps=steps, **({"freeze_vocab": True} if a.freeze_vocab else {}),
                                    **({"heads": heads} if heads != [8, 2] else {}),
                                    **({"family": a.family} if a.family != "llama" else {}),
                                    **({"head_chunks": chunks} if chunks != 1 else {}))
                        row = measure(task)
                        rows = [r for r in rows if {k: r.get(k) for k in task if k != "steps"}
                                != {k: task[k] for k in task if k != "steps"}] + [row]
                        print(f"{seq_len:>6} {sp:>2} {vocab:>6} {feature:<16}{chunk_cell(chunks)} "
                              f"{row['peak_mib']:>9.1f} {row['grad_mib']:>9.1f} {row['step_s']:>8.2f}", flush=True)
                    if a.json:
                        with open(a.json, "w") as f:
                            json.dump(rows, f, indent=1)
    if a.plot and rows:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
