"""How a facade applies a step to its backend's answer, written once for both SDKs.

The blocking facades get answers at once (`now`, `found_now`); the asyncio ones get awaitables
(`later`, `later_chain`, `gather_later`, `found_later`). api.py's `_Blocking` and aio.py's
`_Awaiting` pick one set, so every facade method is written once (api.py says how).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from k3sys.sandbox.errors import NotFoundError

T = TypeVar("T")
R = TypeVar("R")


def now(value: T, then: Callable[[T], R]) -> R:
    """The blocking facades' step: the backend has answered already."""
    return then(value)


async def later(value: Awaitable[T], then: Callable[[T], R]) -> R:
    """The asyncio facades' step: the backend gave an awaitable."""
    return then(await value)


async def later_chain(value: Awaitable[T], then: Callable[[T], Any]) -> Any:
    """`later` where the step itself may give an awaitable (a second call that needs the first's answer)."""
    step = then(await value)
    return await step if inspect.isawaitable(step) else step


async def gather_later(values: list[Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*values))


def found_now(call: Callable[[], T]) -> bool:
    """The blocking facades' E2B-style answer of a call on something that may be gone: True, or
    False on NotFoundError."""
    try:
        call()
    except NotFoundError:
        return False
    return True


async def found_later(call: Callable[[], Awaitable[T]]) -> bool:
    try:
        await call()
    except NotFoundError:
        return False
    return True
