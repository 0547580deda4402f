"""Lazy package exports: a subpackage names what it exports and where, and each module is imported on
first access, so `import k3sys.<pkg>` (and the CLI) start without importing torch."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """Return a module-level `__getattr__` for `package` that resolves `name` from
    `package.<exports[name]>` on first access."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{exports[name]}"), name)

    return __getattr__
