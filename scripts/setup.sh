#!/usr/bin/env bash
# Installs everything ulysses needs into .venv (PyTorch 2.13 from pip, build and test tools)
# and the few Debian packages the C++ build uses. Idempotent; works on Debian 12 and 13.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/debian.sh
ensure_build_packages
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
want=(torch==2.13.0 'scikit-build-core>=1.1' pytest numpy hypothesis clang-format==18.1.8 ruff==0.17.6 mypy==2.4.1 transformers==5.24.0)
if ! .venv/bin/python -c "import torch, pytest, scikit_build_core, numpy, hypothesis, clang_format, ruff, mypy, transformers; assert torch.__version__.startswith('2.13.'); assert tuple(map(int, scikit_build_core.__version__.split('.')[:2])) >= (1, 1)" 2>/dev/null; then
  echo "setup: installing ${want[*]} into .venv"
  # (This machine's pip configuration warns about index folders it lacks: noise, filtered.)
  .venv/bin/pip install -q --disable-pip-version-check "${want[@]}" 2>&1 |
    { grep -v "^WARNING: Location" || true; }
fi
# Optional extras for the Trainer/TRL integration tests (tests/python/test_trainer.py), which
# skip and say why without them: transformers' Trainer needs accelerate, image processors
# (TRL's VLM collator calls one) pillow.
extras=(accelerate==1.15.0 trl==1.16.0 pillow==13.0.0)
if ! .venv/bin/python -c "import accelerate, trl, PIL" 2>/dev/null; then
  echo "setup: installing the optional ${extras[*]} into .venv"
  .venv/bin/pip install -q --disable-pip-version-check "${extras[@]}" 2>&1 | { grep -v "^WARNING: Location" || true; } ||
    echo "setup: could not install ${extras[*]}; the Trainer and TRL tests will skip"
fi
