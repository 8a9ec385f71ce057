"""The torch requirement of the ulysses-sp distribution, made at build time: a
``[[tool.dynamic-metadata]]`` provider (pyproject.toml; scikit-build-core >= 1.1).

The extension links the libtorch it compiles against, and its C++ ABI (from 2.14 its C++
standard too) changes between torch releases, so the package requires exactly that release:
``torch==X.Y.*``. An isolated build (``pip install .``) compiles against build-system.requires'
torch; ``pip install --no-build-isolation .`` against the torch already installed, which the
requirement then keeps instead of replacing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def torch_release() -> str:
    """``X.Y`` of the torch this build compiles against (the one it imports)."""
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def dynamic_metadata(settings: Mapping[str, Any], project: Mapping[str, Any]) -> dict[str, list[str]]:
    if settings:
        raise RuntimeError(f"torch_requirement takes no settings; got {sorted(settings)}")
    return {"dependencies": [f"torch=={torch_release()}.*"]}
