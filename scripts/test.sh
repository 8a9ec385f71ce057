#!/usr/bin/env bash
# Builds ulysses and runs every test: the C++ suite (GoogleTest through ctest) and the Python
# suite (pytest: ops, module, torch.compile, CLI end to end under torchrun), then the wheel in a
# fresh venv (scripts/test_wheel.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/format.sh --check
bash scripts/build.sh
export OMP_NUM_THREADS=1
(cd build && ctest -j 2 --output-on-failure --timeout 300)
# The batched transport, the way NCCL needs point-to-point posted (GroupOptions::transport): the
# exchange, projected, ring and attention sweeps again on Gloo, exact against the same
# references. This is how the device path's logic is tested where there is no GPU.
# (Each suite as one process: ctest's process per test would spend minutes on group set-up.)
for suite in all_to_all_test projected_exchange_test ring_attention_test distributed_attention_test; do
  echo "test: $suite with ULYSSES_TRANSPORT=batched"
  ULYSSES_TRANSPORT=batched timeout 600 "build/$suite" --gtest_brief=1
done
.venv/bin/python -m pytest -q tests/python
ULYSSES_TRANSPORT=batched .venv/bin/python -m pytest -q tests/python/test_ring.py tests/python/test_parts.py \
  tests/python/test_hf.py -k "not test_hf or test_loss_and_every_gradient_equal_the_unsharded_model"
# The GPU check's own code on the CPU, small sizes: it must not fail on a GPU for a reason a CPU
# shows (scripts/gpu_check.sh runs it in full on a GPU).
.venv/bin/python bench/gpu_check.py --device cpu --quick --out build/gpu_check
# The wheel, installed into a fresh venv that holds only torch, and its smoke set.
bash scripts/test_wheel.sh
