#!/usr/bin/env bash
# Formats the C++ sources with the repository's .clang-format (Google style, 100 columns).
# `scripts/format.sh --check` changes nothing and fails if any file needs formatting (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
files=$(git ls-files '*.cpp' '*.h')
if [ "${1:-}" = "--check" ]; then
  .venv/bin/clang-format --dry-run --Werror $files && echo "format: all C++ files are formatted"
else
  .venv/bin/clang-format -i $files
fi
