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
.venv/bin/python -m pytest -q tests/python
# The wheel, installed into a fresh venv that holds only torch, and its smoke set.
bash scripts/test_wheel.sh
