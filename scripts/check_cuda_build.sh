#!/usr/bin/env bash
# Builds the whole project (library, Python extension, CLI, C++ tests) against the CUDA build of
# PyTorch 2.14.1 that lies on this machine's disk, with the machine's CUDA toolkit, into
# build-cuda/: proof that every device path compiles and links against libtorch_cuda and
# c10d's NCCL backend. Nothing runs on a GPU here (there is none); `--run-cpu-tests` also runs
# the C++ suite from that build on the CPU. `--wheel` instead builds the ulysses-sp wheel for
# that torch (scripts/build_wheel.sh: it requires torch==2.14.*) into build-cuda/wheel/.
#
#   scripts/check_cuda_build.sh [--run-cpu-tests | --wheel]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/debian.sh
ensure_build_packages
# The toolkit: CUDA_HOME, or where nvcc lives (/usr/local/cuda on these machines).
cuda_home=${CUDA_HOME:-/usr/local/cuda}
nvcc=$cuda_home/bin/nvcc
[ -x "$nvcc" ] || { echo "check_cuda_build: no CUDA toolkit at $cuda_home (set CUDA_HOME)"; exit 1; }
if [ ! -x .venv-cuda/bin/python ]; then
  echo "check_cuda_build: creating .venv-cuda"
  python3 -m venv .venv-cuda
fi
if ! .venv-cuda/bin/python -c "import torch; assert torch.__version__.startswith('2.14.1') and torch.version.cuda" 2>/dev/null; then
  echo "check_cuda_build: installing torch==2.14.1 (CUDA build, several GB) into .venv-cuda"
  .venv-cuda/bin/pip install -q --disable-pip-version-check torch==2.14.1 2>&1 |
    { grep -v "^WARNING: Location" || true; }
fi
.venv-cuda/bin/python -W ignore -c "import torch; print('check_cuda_build: torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', torch.cuda.nccl.version())"
echo "check_cuda_build: $("$nvcc" --version | tail -1)"
# The machine's toolkit has no NVRTC; the NVIDIA wheel torch depends on does.
nvrtc=$(ls .venv-cuda/lib/python3.11/site-packages/nvidia/cu*/lib/libnvrtc.so.* | grep -v builtins | head -n 1)
mkdir -p build-cuda
if [ "${1:-}" = "--wheel" ]; then
  echo "check_cuda_build: building the wheel (log: build-cuda/wheel.log)"
  .venv-cuda/bin/python -c "import scikit_build_core" 2>/dev/null ||
    .venv-cuda/bin/pip install -q --disable-pip-version-check scikit-build-core 2>&1 |
    { grep -v "^WARNING: Location" || true; }
  bash scripts/build_wheel.sh .venv-cuda/bin/python build-cuda/wheel \
    -Ccmake.define.CMAKE_CUDA_COMPILER="$nvcc" -Ccmake.define.CUDAToolkit_ROOT="$cuda_home" \
    -Ccmake.define.CUDA_TOOLKIT_ROOT_DIR="$cuda_home" -Ccmake.define.CUDA_nvrtc_LIBRARY="$PWD/$nvrtc" \
    >build-cuda/wheel.log 2>&1 || { tail -n 30 build-cuda/wheel.log; echo "check_cuda_build: wheel failed"; exit 1; }
  wheel=$(ls build-cuda/wheel/ulysses_sp-*.whl)
  echo "check_cuda_build: $wheel ($(du -h "$wheel" | cut -f1))"
  unzip -p "$wheel" '*.dist-info/METADATA' | grep -E "^(Name|Version|Requires-Dist): " | sed 's/^/check_cuda_build:   /'
  unzip -p "$wheel" ulysses/torch_version.txt | sed 's/^/check_cuda_build:   compiled against torch /'
  exit 0
fi
rm -f build-cuda/CMakeCache.txt  # Caffe2's CUDA settings are cached from the first configure.
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython3_EXECUTABLE="$PWD/.venv-cuda/bin/python" -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DCUDAToolkit_ROOT="$cuda_home" -DCUDA_TOOLKIT_ROOT_DIR="$cuda_home" -DCUDA_nvrtc_LIBRARY="$nvrtc" \
  -DULYSSES_BUILD_TESTS=ON -DULYSSES_BUILD_PYTHON=ON \
  -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >build-cuda/check.log 2>&1 ||
  { tail -n 30 build-cuda/check.log; echo "check_cuda_build: configure failed (log: build-cuda/check.log)"; exit 1; }
grep -E "CUDA|Caffe2: Found|NCCL" build-cuda/check.log | sed 's/^/check_cuda_build: cmake: /' | head -n 8 || true
cmake --build build-cuda -j 2 >>build-cuda/check.log 2>&1 ||
  { grep -E "error|FAILED" build-cuda/check.log | head -n 30; echo "check_cuda_build: build failed (log: build-cuda/check.log)"; exit 1; }
lib=$(ls build-cuda/libulysses.so)
echo "check_cuda_build: built libulysses.so, the extension $(cd build-cuda && find . -name '_C*.so' | head -n 1),"
echo "check_cuda_build: the CLI and $(ls build-cuda | grep -cE '_test$') test binaries"
echo "check_cuda_build: $lib links:"
ldd "$lib" | grep -E "torch_cuda|c10_cuda|cudart|nccl" | sed 's/ (0x.*//; s/^\s*/check_cuda_build:   /'
if [ "${1:-}" = "--run-cpu-tests" ]; then
  (cd build-cuda && OMP_NUM_THREADS=1 ctest -j 2 --output-on-failure --timeout 300 -E '^fuzz_' 2>&1 |
    grep -vE '^ +Start |^[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed')
fi
echo "check_cuda_build: ok"
