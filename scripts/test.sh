#!/usr/bin/env bash
# Builds ulysses and runs every test (GoogleTest through ctest, CLI end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build
ctest -j 2 --output-on-failure --timeout 300
