#!/usr/bin/python3
"""Turns the JSON written by `ulysses bench ... --json` into PNG plots under docs/.

usage: scripts/plot_bench.py docs/bench_a2a.json docs/bench_attention.json docs/bench_layer*.json
Each file is an array of records; the plot is chosen by the fields a record has.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")


def load(paths):
    records = []
    for p in paths:
        with open(p) as f:
            records.extend(json.load(f))
    return records


def plot_a2a(records):
    recs = [r for r in records if "ours_ms" in r]
    if not recs:
        return
    labels = [f"S={r['seq_len']}\n{r['heads']} {r['q_heads']}/{r['kv_heads']}" for r in recs]
    x = range(len(recs))
    w = 0.21
    fig, ax = plt.subplots(figsize=(max(6, len(recs) * 1.3), 4))
    ax.bar([i - 1.5 * w for i in x], [r["raw_ms"] for r in recs], w,
           label="raw all_to_all (same bytes, flat buffers)")
    ax.bar([i - 0.5 * w for i in x], [r["ours_ms"] for r in recs], w, label="ulysses")
    ax.bar([i + 0.5 * w for i in x], [r.get("parts_ms", 0) for r in recs], w,
           label="ulysses, head parts (projected per rank)")
    ax.bar([i + 1.5 * w for i in x], [r.get("reference_ms", 0) for r in recs], w,
           label="reference algorithm")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("ms (forward all-to-alls, slowest rank)")
    ax.set_yscale("log")
    ax.set_title(f"All-to-all around attention, P={recs[0]['sp']}, D={recs[0]['head_dim']}, fp32, Gloo")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "bench_a2a.png"), dpi=110)


def plot_attention(records):
    recs = [r for r in records if "fused_gflops" in r]
    if not recs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for causal in (False, True):
        rs = sorted([r for r in recs if r["causal"] == causal], key=lambda r: r["seq_len"])
        tag = "causal" if causal else "full"
        axes[0].plot([r["seq_len"] for r in rs], [r["fused_ms"] for r in rs], "o-",
                     label=f"fused ({tag})")
        rm = [r for r in rs if "math_ms" in r]
        axes[0].plot([r["seq_len"] for r in rm], [r["math_ms"] for r in rm], "s--",
                     label=f"math reference ({tag})")
        axes[1].plot([r["seq_len"] for r in rs], [r["fused_pct_of_matmul"] for r in rs], "o-",
                     label=f"fused ({tag})")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("sequence length")
    axes[0].set_ylabel("forward+backward ms")
    axes[0].legend(fontsize=8)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("sequence length")
    axes[1].set_ylabel("% of at::matmul GFLOP/s")
    axes[1].legend(fontsize=8)
    fig.suptitle("Local attention on one rank (B=1, Hq=8, Hkv=2, D=64, fp32, 2 threads)")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "bench_attention.png"), dpi=110)


def plot_layer(records):
    recs = [r for r in records if "peak_bytes" in r and "layer_ms" in r]
    if not recs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for sp in sorted({r["sp"] for r in recs}):
        rs = sorted([r for r in recs if r["sp"] == sp], key=lambda r: r["seq_len"])
        axes[0].plot([r["seq_len"] for r in rs], [r["layer_ms"] for r in rs], "o-", label=f"P={sp}")
        axes[1].plot([r["seq_len"] for r in rs], [r["peak_bytes"] / 2**20 for r in rs], "o-",
                     label=f"P={sp}")
    for ax, ylabel in zip(axes, ["forward+backward ms (slowest rank)", "peak MiB per rank"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle("DistributedAttention layer (Hq=8, Hkv=2, D=64, causal) on local ranks")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "bench_layer.png"), dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    data = load(sys.argv[1:])
    os.makedirs(OUT, exist_ok=True)
    plot_a2a(data)
    plot_attention(data)
    plot_layer(data)
    print("plots written to", os.path.normpath(OUT))
