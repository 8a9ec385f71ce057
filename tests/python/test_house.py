"""The house rules the tree itself must keep (docs/architecture.md): every include runs down
the floors, the plan floor compiles against c10 alone, each floor registers its own ops in files
of at most ~500 lines, and Python keeps no copy of a rule that lives in C++."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The floors, bottom up, and the public headers on each (include/ulysses/). src/dispatch/ holds
# what every floor's op registration shares and sits just above the plan.
FLOORS = ["plan", "dispatch", "kernels", "transport", "attention", "training"]
PUBLIC = {
    "plan": ["partition.h", "exchange_plan.h", "mask_decision.h", "attention_rules.h", "mesh_plan.h"],
    "kernels": ["attention.h", "flash_attention.h"],
    "transport": ["group.h", "collective_recorder.h", "mesh.h", "all_to_all.h"],
    "attention": ["mask.h", "ring_attention.h", "distributed_attention.h"],
    "training": ["sharding.h", "tiled.h"],
}
_INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)
_SYSTEM = re.compile(r"^#include <([^>]+)>", re.M)


def _floor_of_include(path: str) -> str | None:
    """The floor of a quoted include (None: not the library's, e.g. a test helper)."""
    if path.startswith("ulysses/"):
        name = path.split("/", 1)[1]
        return next(f for f, headers in PUBLIC.items() if name in headers)
    first = path.split("/", 1)[0]
    return first if first in FLOORS else None


def _library_files() -> list[tuple[Path, str]]:
    """Every file of the library with its floor."""
    files = []
    for floor, headers in PUBLIC.items():
        files += [(ROOT / "include" / "ulysses" / h, floor) for h in headers]
    for floor in FLOORS:
        files += [(p, floor) for p in sorted((ROOT / "src" / floor).glob("*.*"))]
    return files


def test_every_public_header_has_a_floor():
    on_disk = sorted(p.name for p in (ROOT / "include" / "ulysses").glob("*.h"))
    assert on_disk == sorted(h for headers in PUBLIC.values() for h in headers)
    assert sorted(p.name for p in (ROOT / "src").iterdir() if p.is_dir()) == sorted(FLOORS)


def test_no_include_runs_upward():
    upward = []
    for path, floor in _library_files():
        for target in _INCLUDE.findall(path.read_text()):
            target_floor = _floor_of_include(target)
            assert target_floor is not None or target == "pch.h", f"{path}: unknown include {target}"
            if target_floor is not None and FLOORS.index(target_floor) > FLOORS.index(floor):
                upward.append(f"{path.relative_to(ROOT)} ({floor}) includes {target} ({target_floor})")
    assert not upward, "\n".join(upward)


def test_public_headers_include_no_private_header():
    for headers in PUBLIC.values():
        for h in headers:
            for target in _INCLUDE.findall((ROOT / "include" / "ulysses" / h).read_text()):
                assert target.startswith("ulysses/"), f"include/ulysses/{h} includes the private {target}"


def test_the_plan_floor_needs_no_tensor_library():
    plan = [p for p, floor in _library_files() if floor == "plan"]
    for path in plan:
        for target in _SYSTEM.findall(path.read_text()):
            assert not target.startswith(("ATen/", "torch/")), f"{path.relative_to(ROOT)} includes <{target}>"


@pytest.mark.parametrize("floor", ["kernels", "transport", "attention", "training"])
def test_each_floor_registers_its_own_ops(floor):
    registrations = sorted((ROOT / "src" / floor).glob("*ops.cpp"))
    assert registrations, f"src/{floor} registers no ops"
    for path in registrations:
        text = path.read_text()
        assert "TORCH_LIBRARY_FRAGMENT(ulysses" in text
        assert len(text.splitlines()) <= 500, f"{path.relative_to(ROOT)}: over 500 lines"
    others = [p for p in (ROOT / "src").rglob("*.cpp") if "TORCH_LIBRARY" in p.read_text()]
    assert all(p.name.endswith("ops.cpp") for p in others), others


def test_python_reads_the_rules_from_cpp():
    """The rules with a home in C++ are read through _C: no copy of their values in Python."""
    import ulysses
    from ulysses import _C, groups, ops, tiled

    assert tiled.IGNORE_INDEX == _C.IGNORE_INDEX == -100
    assert groups.DEFAULT_TIMEOUT.total_seconds() * 1000 == _C.DEFAULT_TIMEOUT_MS
    assert ops.LOCAL_KERNELS == tuple(_C.local_kernels())
    assert tiled._tile_bounds(7, 3) == _C.even_split(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert ulysses.plan(5, 5, 3, seq_len=7)["seq_lens"] == [3, 2, 2]  # The same rule for tokens.
    sources = "\n".join(p.read_text() for p in (ROOT / "python" / "ulysses").glob("*.py"))
    for copy in ("-100", "120_000", "seconds=120", '"fused", "sdpa"'):
        assert copy not in sources, f"python/ulysses repeats the C++ rule {copy!r}"


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the directed graph ``edges`` (as its nodes, first repeated last), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def _python_imports() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports, at any depth of its code
    (a function's import closes a cycle as surely as the module's, once the function runs)."""
    import ast

    package = ROOT / "python" / "ulysses"
    modules = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if p.is_dir()
                                                           and (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        name = path.relative_to(package).with_suffix("").parts[0]
        found = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ulysses")):
                parts = (node.module or "").removeprefix("ulysses").lstrip(".").split(".")
                if parts[0]:
                    found.add(parts[0])
                else:  # from . import a, b
                    found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name.split(".")[1] for alias in node.names
                             if alias.name.startswith("ulysses."))
        found &= modules
        found.discard(name)
        found.discard("__init__")
    return edges


def test_no_python_import_cycle():
    cycle = _cycle(_python_imports())
    assert not cycle, "python/ulysses imports in a cycle: " + " -> ".join(cycle)


def test_no_include_cycle():
    edges: dict[str, set[str]] = {}
    files = [p for p in (ROOT / "include").rglob("*.h")] + [p for p in (ROOT / "src").rglob("*.*")]
    for path in files:
        key = str(path.relative_to(ROOT))
        for target in _INCLUDE.findall(path.read_text()):
            for base in ("include", "src"):
                if (ROOT / base / target).exists():
                    edges.setdefault(key, set()).add(f"{base}/{target}")
    cycle = _cycle(edges)
    assert not cycle, "headers include each other in a cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _public_headers() -> list[Path]:
    return sorted((ROOT / "include" / "ulysses").glob("*.h"))


def test_the_public_api_holds_no_internals():
    """include/ulysses/ is the API: no `detail` namespace, no friend of a detail function, and
    no counter or hook that exists for the tests (those live in src/, which tests may include)."""
    found = []
    for path in _public_headers():
        text = path.read_text()
        code = "\n".join(line.split("//", 1)[0] for line in text.splitlines())
        if re.search(r"\bnamespace\s+(\w+::)*detail\b", code):
            found.append(f"{path.name}: a detail namespace")
        if re.search(r"\bfriend\b[^;]*\bdetail::", code):
            found.append(f"{path.name}: a friend of a detail function")
        if re.search(r"\bfor (the )?tests\b|\btest hook", text, re.I):
            found.append(f"{path.name}: something for the tests")
    assert not found, "\n".join(found)


def test_every_environment_variable_is_read_in_one_place():
    """The library reads its ULYSSES_* variables in src/transport/environment.cpp only (the CLI's
    test hooks where they act: its checkpoint file, its training loop); each one read is declared
    in environment.h's list."""
    readers = {}
    for folder in ("src", "tools", "support", "bench", "bindings", "include"):
        for path in (ROOT / folder).rglob("*.*"):
            for name in re.findall(r'getenv\("(ULYSSES_\w+)"\)', path.read_text()):
                readers.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    allowed = {"src/transport/environment.cpp", "tools/train_checkpoint.cpp", "tools/train.cpp"}
    assert readers and all(paths <= allowed for paths in readers.values()), readers
    declared = (ROOT / "src" / "transport" / "environment.h").read_text()
    assert all(name in declared for name in readers), sorted(readers)
