"""Refuses a torch release other than the one the extension was compiled against (its C++ ABI
differs: the extension would fail to load with undefined symbols, or load and misbehave).
Imported by the package before the extension."""

from __future__ import annotations

import os
import sys

import torch


def check() -> None:
    # The package's folders: an editable install has the sources' and the build's.
    folders = sys.modules["ulysses"].__path__
    paths = [p for p in (os.path.join(d, "torch_version.txt") for d in folders) if os.path.exists(p)]
    if not paths:  # Not installed (a bare build tree): nothing to compare.
        return
    with open(paths[0]) as f:
        built = f.read().strip()
    running = torch.__version__.split("+")[0]
    if built.split(".")[:2] != running.split(".")[:2]:
        raise ImportError(f"ulysses was compiled against torch {built} but torch {running} is installed; "
                          f"install torch=={built} or rebuild ulysses against torch {running}")


check()
