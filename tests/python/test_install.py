"""The installed package: its distribution name, and the environments it refuses with an error
that says what to do (another torch release; the unrelated `ulysses` distribution beside it)."""

from __future__ import annotations

import os
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


def test_import_beside_the_unrelated_ulysses_distribution_says_what_to_do(tmp_path):
    # What `pip install ulysses` (physics software, 3.0.1 on PyPI) leaves besides its files.
    info = tmp_path / "ulysses-3.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ulysses\nVersion: 3.0.1\n"
                                   "Summary: Universal LeptogeneSiS Equation Solver\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", "import ulysses"], capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode != 0
    assert ("ImportError: the distribution 'ulysses' 3.0.1 (Universal LeptogeneSiS Equation Solver) is "
            f"installed in {tmp_path}; it is not this package (ulysses-sp)") in r.stderr, r.stderr
    assert "Run `pip uninstall ulysses` and reinstall ulysses-sp" in r.stderr


def test_the_distribution_is_ulysses_sp():
    from importlib import metadata

    import ulysses

    assert metadata.version("ulysses-sp") == ulysses.__version__


def test_the_torch_requirement_follows_the_torch_the_build_compiles_against(tmp_path):
    """The package requires torch==X.Y.* of the torch its build imports (cmake/torch_requirement.py),
    so `pip install --no-build-isolation .` keeps a user's torch instead of replacing it. A
    stand-in torch 2.11 first on the path, then the build backend's own metadata hook (no
    compile): the requirement follows it."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    fake = tmp_path / "stand_in" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '2.11.0+cu128'\n")
    out = tmp_path / "metadata"
    out.mkdir()
    code = ("import sys; from scikit_build_core.build import prepare_metadata_for_build_wheel as p; "
            "print(p(sys.argv[1]))")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "stand_in"))
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=240,
                       cwd=root, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    metadata = (out / r.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires == ["Requires-Dist: torch==2.11.*"], requires


def test_the_installed_package_requires_the_torch_it_was_built_against():
    from importlib import metadata

    import torch

    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert f"torch=={release}.*" in (metadata.requires("ulysses-sp") or []), metadata.requires("ulysses-sp")
