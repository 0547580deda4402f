"""E2B's methods that work on a sandbox or on an id: `sbx.kill()` and `Sandbox.kill(sandbox_id)`.

E2B's SDK lets `kill`, `set_timeout`, `get_info`, `pause`, `create_snapshot`, `fork` and `connect`
be called on the class with a sandbox id first (and connection options by keyword), as well as on
a sandbox. `by_id` gives a facade method that second form: on the class it connects (`conn`),
makes a handle on the id and calls the method, so both forms run the same code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from k3sys.sandbox.sdk.connection import ConnectionOpts

__all__ = ["by_id"]

_CONN = tuple(ConnectionOpts.__annotations__)  # the keywords that choose a backend, taken off a class call


class by_id:  # noqa: N801 - used as a decorator, named like one
    """Decorator: `method(self, ...)` also callable as `Class.method(sandbox_id, ..., **conn)`.

    `Class.method(sandbox, ...)` with a handle first is the instance call, as in E2B's SDK."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type) -> Callable[..., Any]:
        if obj is not None:
            return self.method.__get__(obj, owner)

        @functools.wraps(self.method)
        def on_class(sandbox: Any, *args: Any, **kwargs: Any) -> Any:
            conn = {k: kwargs.pop(k) for k in _CONN if k in kwargs}  # a handle knows its backend already
            if isinstance(sandbox, owner):
                return self.method(sandbox, *args, **kwargs)
            if not isinstance(sandbox, str):
                raise TypeError(f"{owner.__name__}.{self.name}: the first argument is a sandbox id (str) or a "
                                f"{owner.__name__}, got {type(sandbox).__name__}")
            return self.method(owner(owner._connect(conn), sandbox), *args, **kwargs)
        return on_class
