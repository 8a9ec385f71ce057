"""Checks the environment before the extension loads, so that a broken one fails with an error
that says what to do:

- the torch release must be the one the extension was compiled against (its C++ ABI differs:
  the extension would fail to load with undefined symbols, or load and misbehave);
- the unrelated PyPI distribution ``ulysses`` (physics software) must not be installed beside
  this one (``ulysses-sp``): both provide the top-level package ``ulysses``, so pip lets their
  files overwrite each other."""

from __future__ import annotations

import os
import sys
from importlib import metadata

import torch

DISTRIBUTION = "ulysses-sp"


def check_torch_release() -> None:
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


def check_no_other_ulysses() -> None:
    try:
        other = metadata.distribution("ulysses")
    except metadata.PackageNotFoundError:
        return
    where = other.locate_file("")
    raise ImportError(
        f"the distribution 'ulysses' {other.version} ({other.metadata['Summary']}) is installed in {where}; "
        f"it is not this package ({DISTRIBUTION}), but it also provides the top-level package 'ulysses', "
        f"so the two overwrite each other's files. Run `pip uninstall ulysses` and reinstall {DISTRIBUTION}, "
        "or keep the two in separate environments")


check_no_other_ulysses()
check_torch_release()
