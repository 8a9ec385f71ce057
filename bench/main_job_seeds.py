"""Does the main job learn whatever the seed? Runs ``ulysses train`` (the main job, 4 local ranks)
once per seed and prints, for each, the first evaluation at held-out accuracy 1 and the last
step's accuracy and loss. Another host's float order changes a run's trajectory as another seed
does; a setting that learns only for most seeds is at the edge.

    OMP_NUM_THREADS=1 .venv/bin/python bench/main_job_seeds.py --seeds 0 1 2 3 4 [-- --lr 5e-3]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys


def run(seed: int, eval_every: int, extra: list[str]) -> dict:
    ulysses = shutil.which("ulysses", path=os.path.dirname(sys.executable)) or "ulysses"
    done = subprocess.run([ulysses, "train", "--seed", str(seed), "--eval-every", str(eval_every), *extra],
                          capture_output=True, text=True, check=True)
    evals = [(int(m[1]), float(m[2])) for m in re.finditer(r"eval step (\d+): held-out retrieval accuracy (\S+)",
                                                            done.stdout)]
    losses = re.findall(r"step \d+/\d+ loss (\S+)", done.stdout)
    return {"seed": seed, "first_at_1": next((s for s, a in evals if a == 1.0), None),
            "final_accuracy": evals[-1][1], "final_loss": float(losses[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("extra", nargs="*", help="more `ulysses train` options (after --)")
    args = parser.parse_args()
    print(f"ulysses train {' '.join(args.extra)} (eval every {args.eval_every} steps)")
    print(f"{'seed':>4} {'first step at accuracy 1':>24} {'final accuracy':>14} {'final loss':>10}")
    for seed in args.seeds:
        r = run(seed, args.eval_every, args.extra)
        print(f"{r['seed']:>4} {str(r['first_at_1']):>24} {r['final_accuracy']:>14.3g} {r['final_loss']:>10.4f}",
              flush=True)


if __name__ == "__main__":
    main()
