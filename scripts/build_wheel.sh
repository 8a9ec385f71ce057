#!/usr/bin/env bash
# Builds the ulysses-sp wheel against the torch installed in a given Python environment, and
# pins the wheel's torch requirement to that release (torch==X.Y.*: the C++ ABI, and from 2.14
# the C++ standard, change between releases).
#
#   scripts/build_wheel.sh PYTHON OUT_DIR [-Ccmake.define.NAME=VALUE ...]
#
# pyproject.toml's pin (torch==2.13.*) is the default environment's; for another release the
# wheel is built from a copy of the tracked sources with that one line changed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$1 out=$(realpath -m "$2")
shift 2
torch_release=$("$python" -c "import torch; print('.'.join(torch.__version__.split('+')[0].split('.')[:2]))")
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$src"
sed -i "s/^dependencies = \[\"torch==[0-9.]*\.\*\"\]/dependencies = [\"torch==$torch_release.*\"]/" "$src/pyproject.toml"
grep -q "^dependencies = \[\"torch==$torch_release\.\*\"\]" "$src/pyproject.toml" ||
  { echo "build_wheel: pyproject.toml has no 'dependencies = [\"torch==X.Y.*\"]' line"; exit 1; }
mkdir -p "$out"
"$python" -m pip wheel --no-build-isolation --no-deps --disable-pip-version-check \
  -Cbuild-dir="$out/build" "$@" "$src" -w "$out"
