#!/usr/bin/env bash
# The one prepared check for a machine with an NVIDIA GPU: the device machine (one H200, its
# image's python3 with a CUDA build of torch 2.11, CMake, ninja, pybind11 and scikit-build-core;
# no network). Builds only the extension, against that torch, with the CUDA hints it needs
# (scripts/cuda_hints.sh), into build-gpu/, then runs bench/gpu_check.py: every part guarded, so
# one failure does not hide the rest. No CPU test gate: CI runs those, and
# `bench/gpu_check.py --device cpu --quick` too. About 3 minutes of build and 2 of checks with
# 16 cores.
#
#   scripts/gpu_check.sh [OUT_DIR]      (OUT_DIR/summary.txt, gpu_check.json, build.log)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-build-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
nvidia-smi -L || true
python3 -c "import torch; print('gpu_check: torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
source scripts/cuda_hints.sh
cuda_hints python3 || exit 1
echo "gpu_check: building the extension into build-gpu/ (log: $out/build.log)"
start=$SECONDS
if ! python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build-gpu \
  -Ccmake.define.ULYSSES_BUILD_TESTS=OFF "${cuda_defines[@]/#-D/-Ccmake.define.}" -e . \
  >"$out/build.log" 2>&1; then
  tail -n 40 "$out/build.log"
  echo "gpu_check: the build failed after $((SECONDS - start)) s"
  exit 1
fi
echo "gpu_check: built in $((SECONDS - start)) s"
python3 bench/gpu_check.py --device cuda --out "$out" 2>&1 | tee "$out/gpu_check.log"
