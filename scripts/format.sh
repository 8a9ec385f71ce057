#!/usr/bin/env bash
# Formats the C++ sources with the repository's .clang-format (Google style, 100 columns) and
# lints the Python with ruff (pyproject.toml's [tool.ruff]; safe fixes applied); checks the
# package's types with mypy.
# `scripts/format.sh --check` changes nothing and fails if any file needs either (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tracked files and new ones not ignored: a file added since the last commit is checked too.
files=$(git ls-files --cached --others --exclude-standard '*.cpp' '*.h')
if [ "${1:-}" = "--check" ]; then
  # One command per line: under set -e a failure in `a && b` would not stop the script.
  .venv/bin/clang-format --dry-run --Werror $files
  echo "format: all C++ files are formatted"
  .venv/bin/ruff check --quiet python tests bench examples
  echo "format: the Python is ruff-clean"
  # The package's types (pyproject.toml's [tool.mypy]; about 35 s without a cache).
  .venv/bin/mypy
  echo "format: the package is mypy-clean"
else
  .venv/bin/clang-format -i $files
  .venv/bin/ruff check --fix python tests bench examples
fi
