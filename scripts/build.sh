#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then builds the C++ core, its tests and the Python package
# into build/ and installs the package (editable) with its `ulysses` command into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "build: compiling ulysses (the first build takes several minutes on 2 cores)"
# Editable install: Python sources are used from python/, the extension is built in build/.
.venv/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
  -Cbuild-dir=build -Ccmake.define.ULYSSES_BUILD_TESTS=ON \
  -Ccmake.define.ULYSSES_NATIVE_ARCH=ON -Cbuild.verbose=true -e . "$@" 2>&1 |
  grep --line-buffered -E '^\[[0-9]+/[0-9]+\]|error|Error' || true
.venv/bin/python -c "import ulysses" || { echo "build: failed (see above)"; exit 1; }
echo "build: done"
