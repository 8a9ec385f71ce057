"""The C++ API from a separate CMake project: find_package(ulysses) against the installed
package (ulysses.cmake_prefix_path), build, link and run."""

from __future__ import annotations

import os
import subprocess

import torch.utils

import ulysses

HERE = os.path.dirname(__file__)


def test_find_package_builds_and_runs(tmp_path):
    prefix = f"{ulysses.cmake_prefix_path};{torch.utils.cmake_prefix_path}"
    src = os.path.join(HERE, "..", "cmake_consumer")
    configure = subprocess.run(["cmake", "-S", src, "-B", str(tmp_path), "-G", "Ninja",
                                f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"],
                               check=True, capture_output=True, text=True)
    # The exported target brings no library that clashes with torch/lib's (libgomp did).
    assert "Cannot generate a safe runtime search path" not in configure.stderr, configure.stderr
    build = subprocess.run(["cmake", "--build", str(tmp_path)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    # Nothing the installed target exports carries machine-specific code generation flags.
    assert "-march=native" not in open(os.path.join(tmp_path, "build.ninja")).read()
    run = subprocess.run([os.path.join(tmp_path, "consumer")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "output [1, 8, 4, 16]" in run.stdout
