#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then builds the C++ core, its tests and the Python package
# into build/ and installs the package (editable) with its `ulysses` command into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "build: compiling ulysses (the first build takes several minutes on 2 cores)"
# Editable install: Python sources are used from python/, the extension is built in build/.
# The compiler's progress lines ([n/N] ...) and errors are shown; the full log is build/pip.log.
mkdir -p build
# Before 0.3 this project's distribution was named `ulysses`, a name taken on PyPI by an
# unrelated package (now `ulysses-sp`): an old install of ours would be refused at import.
old=$(.venv/bin/pip show ulysses 2>/dev/null || true)
if [[ $old == *"Summary: Ulysses sequence parallelism"* ]]; then
  .venv/bin/pip uninstall -y -q --disable-pip-version-check ulysses
fi
: >build/pip.log  # Exists before tail opens it (pip's redirection runs in the background).
set +e
.venv/bin/pip install -v --disable-pip-version-check --no-build-isolation --no-deps \
  -Cbuild-dir=build -Ccmake.define.ULYSSES_BUILD_TESTS=ON \
  -e . "$@" >build/pip.log 2>&1 &
pip_pid=$!
tail -n +1 -f build/pip.log --pid=$pip_pid |
  grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] |error:|FAILED' | sed -u -E 's/^ *//; s/^(.{100}).*/\1/'
wait $pip_pid
status=$?
set -e
if [ $status -ne 0 ] || ! .venv/bin/python -c "import ulysses" 2>/dev/null; then
  tail -n 40 build/pip.log
  echo "build: failed (full log: build/pip.log)"
  exit 1
fi
echo "build: done"
