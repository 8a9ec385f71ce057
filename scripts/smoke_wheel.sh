#!/usr/bin/env bash
# The smoke set of an installed ulysses wheel, run from the current directory (keep it outside
# the repository, so nothing imports the sources instead): torch.ops.ulysses, 2-rank attention
# exact vs single-rank, `ulysses train --check` at P = 2 and `torchrun -m ulysses`. CPU tensors
# only, so it runs on a CUDA build of torch too (scripts/check_cuda_build.sh --smoke).
#
#   scripts/smoke_wheel.sh VENV
set -euo pipefail
venv=$(realpath "$1")
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONWARNINGS="ignore:Failed to initialize NumPy"
"$venv/bin/python" - <<'PY'
import os
import torch
import ulysses
assert "site-packages" in ulysses.__file__, ulysses.__file__
out = torch.ops.ulysses.local_attention(*(torch.randn(1, 2, 4, 8) for _ in range(3)), [0, 1],
                                        None, None, True, 0.0)
print(f"wheel: import ulysses {ulysses.__version__} from {os.path.dirname(ulysses.__file__)}; "
      f"torch.ops.ulysses.local_attention -> {list(out.shape)}")
PY
"$venv/bin/ulysses" --version
export OMP_NUM_THREADS=1
"$venv/bin/ulysses" launch -n 2 -- "$venv/bin/python" "$root/tests/wheel/smoke_attention.py"
"$venv/bin/ulysses" train --nproc 2 --check --seq-len 96 --steps 2 --log-every 1 | tail -n 2
"$venv/bin/torchrun" --nproc_per_node 2 -m ulysses plan --q-heads 4 --kv-heads 2 --sp 2 | tail -n 1
