# The library extension (bindings/module.cpp): planners, shape rules, test hooks. Untyped here:
# its Python callers are the package's own modules, and each call's types are checked in C++.
from typing import Any

def __getattr__(name: str) -> Any: ...
