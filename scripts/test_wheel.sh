#!/usr/bin/env bash
# Builds the wheel once (pip wheel, against .venv's torch), installs it into a fresh venv that
# holds only torch (no editable tree, no build tools), and runs a smoke set there:
# torch.ops.ulysses, 2-rank attention exact vs single-rank, `ulysses train --check` at P = 2,
# `torchrun -m ulysses`, and find_package(ulysses) from a separate CMake project.
set -euo pipefail
cd "$(dirname "$0")/.."
# The torch wheel alone (no numpy) warns on import; that is torch's, not the smoke set's.
export PYTHONWARNINGS="ignore:Failed to initialize NumPy"
root=$PWD
work=build/wheel
rm -rf "$work" && mkdir -p "$work"
echo "wheel: building (pip wheel; the log is $work/pip.log)"
bash scripts/build_wheel.sh .venv/bin/python "$work/dist" >"$work/pip.log" 2>&1 ||
  { tail -n 40 "$work/pip.log"; echo "wheel: build failed"; exit 1; }
wheel=$(ls "$work"/dist/ulysses_sp-*.whl)
echo "wheel: $(basename "$wheel")"
python3 -m venv "$work/venv"
venv=$root/$work/venv
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
"$venv/bin/pip" install -q --disable-pip-version-check "torch==$torch_version" 2>&1 |
  { grep -v "^WARNING: Location" || true; }
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$wheel"
# Away from the repository, so nothing can import the sources instead of the wheel.
cd "$work"
bash "$root/scripts/smoke_wheel.sh" "$venv"
prefix=$("$venv/bin/python" -c "import ulysses, torch.utils; print(ulysses.cmake_prefix_path + ';' + torch.utils.cmake_prefix_path)")
cmake -S "$root/tests/cmake_consumer" -B consumer -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE=Release >consumer.log 2>&1 || { cat consumer.log; exit 1; }
cmake --build consumer >>consumer.log 2>&1 || { cat consumer.log; exit 1; }
./consumer/consumer | tail -n 1
echo "wheel: the installed wheel passed its smoke set"
