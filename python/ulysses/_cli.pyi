# The command-line extension (bindings/cli_module.cpp).
from collections.abc import Callable

def run_cli(argv: list[str], self: list[str], join_world: Callable[[int], str],
            split: Callable[[list[list[int]]], str]) -> int: ...
