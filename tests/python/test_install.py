"""The installed package: it refuses a torch release other than the one it was compiled against."""

from __future__ import annotations

import subprocess
import sys


def test_import_under_another_torch_release_names_both_versions():
    # torch's version string replaced before `import ulysses`, as if torch 2.14.1 were installed.
    code = "import torch; torch.__version__ = '2.14.1+cu128'; import ulysses"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode != 0
    built = torch_built_against()
    assert (f"ImportError: ulysses was compiled against torch {built} but torch 2.14.1 is installed"
            in r.stderr), r.stderr


def torch_built_against() -> str:
    import os

    import ulysses

    for d in ulysses.__path__:
        path = os.path.join(d, "torch_version.txt")
        if os.path.exists(path):
            return open(path).read().strip()
    raise AssertionError("torch_version.txt is not installed with the package")


def test_the_recorded_release_is_the_running_one():
    import torch

    assert torch_built_against().split(".")[:2] == torch.__version__.split(".")[:2]
