#!/usr/bin/env bash
# Builds the whole project (library, Python extension, CLI, C++ tests) against a CUDA build of
# PyTorch (2.14.1, which lies on this machine's disk, unless --torch names another release from
# PyPI: 2.11.0 is the GPU machine's, the oldest supported), with the machine's CUDA toolkit, into
# build-cuda/ (build-cuda-VERSION/ for another release): proof that every device path compiles
# and links against libtorch_cuda and c10d's NCCL backend. Nothing runs on a GPU here (there is
# none); `--run-cpu-tests` also runs the C++ suite from that build on the CPU. `--wheel` instead
# builds the ulysses-sp wheel for that torch (scripts/build_wheel.sh pins torch==X.Y.*) into
# build-cuda*/wheel/, and `--smoke` installs that wheel into the torch's venv and runs the wheel's
# smoke set there on CPU tensors (scripts/smoke_wheel.sh). Not part of CI (a build takes about
# 10 minutes on 2 cores): run it when the torch range or a device path changes.
#
#   scripts/check_cuda_build.sh [--torch VERSION] [--run-cpu-tests | --wheel | --smoke]
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=2.14.1
if [ "${1:-}" = "--torch" ]; then
  torch_version=${2:?check_cuda_build: --torch needs a version}
  shift 2
fi
mode=${1:-}
suffix=""
[ "$torch_version" = 2.14.1 ] || suffix="-$torch_version"
venv=.venv-cuda$suffix build=build-cuda$suffix
source scripts/debian.sh
ensure_build_packages
if [ ! -x $venv/bin/python ]; then
  echo "check_cuda_build: creating $venv"
  python3 -m venv $venv
fi
if ! $venv/bin/python -c "import torch; assert torch.__version__.startswith('$torch_version') and torch.version.cuda" 2>/dev/null; then
  echo "check_cuda_build: installing torch==$torch_version (CUDA build, several GB) into $venv"
  $venv/bin/pip install -q --disable-pip-version-check "torch==$torch_version" 2>&1 |
    { grep -v "^WARNING: Location" || true; }
fi
$venv/bin/python -W ignore -c "import torch; print('check_cuda_build: torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', torch.cuda.nccl.version())"
source scripts/cuda_hints.sh
cuda_hints $venv/bin/python
echo "check_cuda_build: $("$nvcc" --version | tail -1)"
mkdir -p $build
if [ "$mode" = "--wheel" ] || [ "$mode" = "--smoke" ]; then
  echo "check_cuda_build: building the wheel (log: $build/wheel.log)"
  $venv/bin/python -c "import scikit_build_core" 2>/dev/null ||
    $venv/bin/pip install -q --disable-pip-version-check scikit-build-core 2>&1 |
    { grep -v "^WARNING: Location" || true; }
  bash scripts/build_wheel.sh $venv/bin/python $build/wheel "${cuda_defines[@]/#-D/-Ccmake.define.}" \
    >$build/wheel.log 2>&1 || { tail -n 30 $build/wheel.log; echo "check_cuda_build: wheel failed"; exit 1; }
  wheel=$(ls $build/wheel/ulysses_sp-*.whl)
  echo "check_cuda_build: $wheel ($(du -h "$wheel" | cut -f1))"
  unzip -p "$wheel" '*.dist-info/METADATA' | grep -E "^(Name|Version|Requires-Dist): " | sed 's/^/check_cuda_build:   /'
  unzip -p "$wheel" ulysses/torch_version.txt | sed 's/^/check_cuda_build:   compiled against torch /'
  if [ "$mode" = "--smoke" ]; then
    $venv/bin/pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
    smoke=$(mktemp -d)  # Away from the sources.
    (cd "$smoke" && bash "$OLDPWD/scripts/smoke_wheel.sh" "$OLDPWD/$venv")
    rm -rf "$smoke"
    echo "check_cuda_build: the wheel passed its smoke set on torch $torch_version"
  fi
  exit 0
fi
rm -f $build/CMakeCache.txt  # Caffe2's CUDA settings are cached from the first configure.
cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython3_EXECUTABLE="$PWD/$venv/bin/python" "${cuda_defines[@]}" -DULYSSES_BUILD_TESTS=ON -DULYSSES_BUILD_PYTHON=ON \
  -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >$build/check.log 2>&1 ||
  { tail -n 30 $build/check.log; echo "check_cuda_build: configure failed (log: $build/check.log)"; exit 1; }
grep -E "CUDA|Caffe2: Found|NCCL" $build/check.log | sed 's/^/check_cuda_build: cmake: /' | head -n 8 || true
cmake --build $build -j 2 >>$build/check.log 2>&1 ||
  { grep -E "error|FAILED" $build/check.log | head -n 30; echo "check_cuda_build: build failed (log: $build/check.log)"; exit 1; }
lib=$(ls $build/libulysses.so)
echo "check_cuda_build: built libulysses.so, the extension $(cd $build && find . -name '_C*.so' | head -n 1),"
echo "check_cuda_build: the CLI and $(ls $build | grep -cE '_test$') test binaries"
echo "check_cuda_build: $lib links:"
ldd "$lib" | grep -E "torch_cuda|c10_cuda|cudart|nccl" | sed 's/ (0x.*//; s/^\s*/check_cuda_build:   /'
if [ "$mode" = "--run-cpu-tests" ]; then
  (cd $build && OMP_NUM_THREADS=1 ctest -j 2 --output-on-failure --timeout 300 -E '^fuzz_' 2>&1 |
    grep -vE '^ +Start |^[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed')
fi
echo "check_cuda_build: ok"
