#!/usr/bin/env bash
# Reproduces the benchmark tables and docs/*.png (takes ~15 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_BUILD:-}" ] || bash scripts/build.sh >/dev/null
u=.venv/bin/ulysses
mkdir -p docs
$u bench a2a --nproc 2 --seq-lens 256,512,1024,2048,16384 --repeats 7 --json docs/bench_a2a.json
$u bench attention --seq-lens 1024,2048,4096 --repeats 3 --json docs/bench_attention.json
$u bench attention --seq-lens 8192 --no-math --repeats 2 --json docs/bench_attention_8192.json
$u bench attention --seq-lens 4096 --documents 8 --no-math --repeats 3 \
  --json docs/bench_attention_documents.json
$u bench attention --seq-lens 4096 --causal both --no-math --repeats 3 --block-q 64 --block-k 128 \
  --json docs/bench_attention_tiles_64x128.json
$u bench attention --seq-lens 16384 --q-heads 1 --kv-heads 1 --causal 0 --repeats 1 --memory \
  --json docs/bench_attention_memory.json
# A fixed mmap threshold returns every freed tensor to the system, so peak_bytes counts live
# memory, not glibc's heap left over from the previous sequence length.
for p in 1 2 4; do
  MALLOC_MMAP_THRESHOLD_=1048576 $u bench layer --nproc $p --seq-lens 2048,4096,8192 --json docs/bench_layer_p$p.json
done
.venv/bin/python -c "import matplotlib" 2>/dev/null ||
  .venv/bin/pip install -q --disable-pip-version-check matplotlib 2>&1 | { grep -v "^WARNING: Location" || true; }
.venv/bin/python scripts/plot_bench.py docs/bench_a2a.json docs/bench_attention.json \
  docs/bench_attention_8192.json docs/bench_layer_p*.json
