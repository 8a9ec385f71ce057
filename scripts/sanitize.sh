#!/usr/bin/env bash
# The C++ suite (GoogleTest and the fuzz targets' replays) built with AddressSanitizer and
# UndefinedBehaviorSanitizer into build-sanitize/, then run. Any report fails the run. Takes
# ~15 minutes on 2 cores (not part of the test command; see docs/development.md, "Checking").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# -fno-sanitize=vptr: libtorch is built without RTTI checks for UBSan's vptr probe.
cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython3_EXECUTABLE="$PWD/.venv/bin/python" -DULYSSES_BUILD_PYTHON=OFF -DULYSSES_BUILD_TESTS=ON \
  -DCMAKE_CXX_FLAGS="$flags -fno-sanitize=vptr" -DCMAKE_EXE_LINKER_FLAGS="$flags" \
  -DCMAKE_SHARED_LINKER_FLAGS="$flags" >build-sanitize.log 2>&1 || { cat build-sanitize.log; exit 1; }
ninja -C build-sanitize | { grep --line-buffered -E '^\[[0-9]+/[0-9]+\] |error:|FAILED' || true; } |
  sed -u -E 's/^(.{100}).*/\1/'
# Leaks: the embedded Python interpreter (the test ranks' process groups) keeps its objects
# to the end by design. Everything else a sanitizer sees is an error.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export OMP_NUM_THREADS=1
(cd build-sanitize && ctest -j2 --output-on-failure --timeout 900)
echo "sanitize: the suite passed under AddressSanitizer + UndefinedBehaviorSanitizer"
