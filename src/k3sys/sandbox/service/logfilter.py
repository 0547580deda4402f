"""Rate-limited logging for the service: a flood of requests must not become a flood of log lines.

Under a slowloris attack uvicorn and asyncio wrote one warning per bad request or failed accept
(23 MB of log). `RateLimit` is a logging filter with a token bucket per message template (the
logger's name and the unformatted message, so an attacker's input cannot make new keys): each
template passes `burst` lines at once and `per_second` after that; the next line that passes says
how many like it were dropped. `log_config` is uvicorn's logging configuration with the filter on
every handler, and asyncio's logger routed through them too.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

MAX_KEYS = 1024  # templates tracked at once (there are far fewer call sites than that)


class RateLimit(logging.Filter):
    """Pass at most `burst` lines at once and `per_second` on average per message template."""

    def __init__(self, per_second: float = 1.0, burst: int = 10, clock: Any = time.monotonic) -> None:
        super().__init__()
        self.per_second = per_second
        self.burst = burst
        self.clock = clock
        self._mu = threading.Lock()
        self._buckets: dict[tuple[str, str], list[float]] = {}  # key -> [tokens, last refill, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = self.clock()
        with self._mu:
            b = self._buckets.pop(key, None) or [float(self.burst), now, 0]
            self._buckets[key] = b  # most recently used last, so the oldest goes first below
            if len(self._buckets) > MAX_KEYS:
                del self._buckets[next(iter(self._buckets))]
            b[0] = min(float(self.burst), b[0] + (now - b[1]) * self.per_second)
            b[1] = now
            if b[0] < 1:
                b[2] += 1
                return False
            b[0] -= 1
            dropped, b[2] = int(b[2]), 0
        if dropped:
            record.msg = f"{record.msg} [and {dropped} more like it, not logged]"
        return True


def log_config(per_second: float = 1.0, burst: int = 10) -> dict[str, Any]:
    """uvicorn's logging configuration, each handler behind one shared `RateLimit`."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["filters"] = {"rate_limit": {"()": RateLimit, "per_second": per_second, "burst": burst}}
    for handler in cfg["handlers"].values():
        handler["filters"] = ["rate_limit"]
    # asyncio's own errors (a failed accept when descriptors run out) go through the same handler.
    cfg["loggers"]["asyncio"] = {"handlers": ["default"], "level": "WARNING", "propagate": False}
    cfg["loggers"]["k3sys"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return cfg
