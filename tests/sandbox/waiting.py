"""Waiting on a condition, the one way the tests synchronise with what runs beside them (sandboxes,
services, Ray actors): poll with a deadline, never a fixed sleep, so that a busy machine only makes a
test slower, not red. A module of its own so that tests/sandbox/, tests/rollout/ and tests/fleet/
import it by name."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float = 20.0, what: str = "the condition",
               step: float = 0.01) -> T:
    """Call `pred` every `step` seconds until it returns something true, and return that; raise
    AssertionError naming `what` (what never happened) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s (last: {got!r})"
        time.sleep(step)
