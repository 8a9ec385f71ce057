#!/usr/bin/env bash
# Coverage-guided fuzzing with clang's libFuzzer (+ AddressSanitizer, UBSan) of the partition
# planner, the mask decision and the CLI argument parser, starting from the seed corpus in
# tests/fuzz/corpus. Usage: scripts/fuzz.sh [SECONDS per target, default 60]. New inputs go
# to build-fuzz/corpus/<target>; a crash leaves its input in build-fuzz/ and fails the run.
# (The test command replays the seeds and 20000 mutations per target with g++, in ctest.)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
bash scripts/setup.sh >/dev/null
source scripts/debian.sh
ensure_debian_packages clang libclang-rt-dev
torch_dir="$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
mkdir -p build-fuzz
flags=(-std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
  -I include -I src -I support -I tools -I bench -isystem "$torch_dir/include"
  -isystem "$torch_dir/include/torch/csrc/api/include" -D_GLIBCXX_USE_CXX11_ABI=1)
libs=(-L "$torch_dir/lib" -Wl,-rpath,"$torch_dir/lib" -lc10)
# Only the pure plan floor is linked (and instrumented): no tensors, no process groups.
plan_floor=$(echo src/plan/*.cpp)
declare -A sources=(
  [fuzz_partition]="$plan_floor"
  [fuzz_mask_decision]="$plan_floor"
  [fuzz_cli_args]="$plan_floor tools/plan.cpp"
)
for target in fuzz_partition fuzz_mask_decision fuzz_cli_args; do
  echo "fuzz: building $target"
  # shellcheck disable=SC2086
  clang++ "${flags[@]}" "tests/fuzz/$target.cpp" ${sources[$target]} "${libs[@]}" -o "build-fuzz/$target"
  mkdir -p "build-fuzz/corpus/$target"
  echo "fuzz: running $target for $seconds s"
  (cd build-fuzz && ASAN_OPTIONS=detect_leaks=1 "./$target" -max_total_time="$seconds" \
    -print_final_stats=1 "corpus/$target" "../tests/fuzz/corpus/$target" 2>"$target.log") ||
    { tail -n 30 "build-fuzz/$target.log"; echo "fuzz: $target FAILED"; exit 1; }
  grep -E "^stat::(number_of_executed_units|new_units_added)|^#[0-9]+ *DONE" "build-fuzz/$target.log" |
    sed "s/^/fuzz: $target: /"
done
echo "fuzz: no crash, leak or undefined behaviour found"
