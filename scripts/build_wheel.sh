#!/usr/bin/env bash
# Builds the ulysses-sp wheel against the torch installed in a given Python environment. Its
# metadata requires that torch release (torch==X.Y.*: the C++ ABI, and from 2.14 the C++
# standard, change between releases), as every build of the package does
# (cmake/torch_requirement.py).
#
#   scripts/build_wheel.sh PYTHON OUT_DIR [-Ccmake.define.NAME=VALUE ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python=$1 out=$(realpath -m "$2")
shift 2
# From a copy of the tracked sources: the wheel holds nothing a working tree adds.
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$src"
mkdir -p "$out"
"$python" -m pip wheel --no-build-isolation --no-deps --disable-pip-version-check \
  -Cbuild-dir="$out/build" "$@" "$src" -w "$out"
