#!/usr/bin/env bash
# The one prepared check for a machine with an NVIDIA GPU (the device machine: python3 with a
# CUDA build of torch, cmake, ninja, pybind11, scikit-build-core and pytest already there).
# Builds the extension against that torch into build-gpu/, runs the Python suite's CPU tests
# there, then bench/gpu_check.py (CUDA correctness, a2a bus bandwidth, layer time and memory).
#
#   scripts/gpu_check.sh [OUT_DIR]      (results land in OUT_DIR/gpu_check.json and .log)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-build-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi -L
python3 -c "import torch; assert torch.cuda.is_available(); print('gpu_check: torch', torch.__version__, 'CUDA', torch.version.cuda)"
echo "gpu_check: building the extension (build-gpu/)"
python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build-gpu \
  -Ccmake.define.ULYSSES_BUILD_TESTS=OFF -e . \
  >"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 1; }
# The Python suite on this machine's torch, minus what needs transformers 5.24 or torchrun's CLI.
python3 -m pytest -q -x tests/python/test_ops.py tests/python/test_attention.py \
  tests/python/test_compile.py tests/python/test_autosp.py 2>&1 | tail -n 5 | tee "$out/pytest.log"
python3 bench/gpu_check.py --nproc "$(python3 -c 'import torch; print(max(2, min(4, torch.cuda.device_count())))')" \
  --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log"
