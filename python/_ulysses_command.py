"""The ``ulysses`` console command (pyproject.toml's ``[project.scripts]``).

Outside a launcher's ranks (no RANK in the environment), every command line first runs from the
C++ command table without importing torch (about 0.4 s instead of 2-3 s): the table's module,
``ulysses._cli``, is loaded on its own after torch's shared libraries, so the package, which
imports torch, is not. That answers ``--version`` and every ``--help``, refuses a bad command
line (each command's checks that need no rank run before it launches), and is the launcher of
``--nproc N`` (its ranks run ``python -m ulysses``). A command that needs process groups in this
process (one rank, or under torchrun) goes to ``ulysses.__main__``. ``plan`` is answered by
``ulysses._plan``, the pure planner built against c10 alone: it loads neither torch nor
libtorch. (A top-level module: any module inside the package would run the package's
``__init__`` first.)"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

TORCH_LIBRARIES = ("libc10.so", "libtorch_cpu.so", "libtorch.so")  # What ulysses._cli links.


def answers_without_torch(argv: list[str]) -> bool:
    """The command lines the C++ table answers by itself: no command, --version, or a --help
    anywhere before ``--`` (what follows belongs to the command ``launch`` starts)."""
    own = argv[: argv.index("--")] if "--" in argv else argv
    return not argv or argv[0] == "--version" or "--help" in own or "-h" in own


def plans_without_torch(argv: list[str]) -> bool:
    """`ulysses plan ...` (not its --help, which the command table answers)."""
    return bool(argv) and argv[0] == "plan" and not answers_without_torch(argv)


def load_without_torch(module: str, libraries: tuple[str, ...]) -> ModuleType | None:
    """``ulysses.<module>``, loaded after torch's shared ``libraries`` without importing torch or
    the ulysses package; None where that cannot be done (an unusual layout): the caller then
    takes the usual path."""
    torch_spec, package_spec = importlib.util.find_spec("torch"), importlib.util.find_spec("ulysses")
    if torch_spec is None or torch_spec.origin is None or package_spec is None:
        return None
    try:
        for name in libraries:
            ctypes.CDLL(os.path.join(os.path.dirname(torch_spec.origin), "lib", name), mode=ctypes.RTLD_GLOBAL)
        spec = importlib.machinery.PathFinder.find_spec(f"ulysses.{module}", package_spec.submodule_search_locations)
        if spec is None or spec.loader is None:
            return None
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded
    except (OSError, ImportError):
        return None


def load_cli_without_torch() -> ModuleType | None:
    """ulysses._cli (the command table), without importing torch or the package."""
    return load_without_torch("_cli", TORCH_LIBRARIES)


def main() -> int:
    argv = sys.argv[1:]
    if plans_without_torch(argv):
        planner = load_without_torch("_plan", ("libc10.so",))
        if planner is not None:
            return planner.run_plan(argv[1:])
    if answers_without_torch(argv) or "RANK" not in os.environ:
        cli = load_cli_without_torch()
        if cli is not None:
            code = cli.run_cli_without_groups(argv, [sys.executable, "-m", "ulysses"])
            if code is not None:  # (None: it needs process groups here, which torch makes)
                sys.stdout.flush()
                return code
    from ulysses.__main__ import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
