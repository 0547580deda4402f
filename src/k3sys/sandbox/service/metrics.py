"""Prometheus text exposition (format 0.0.4) for the sandbox service.

Written here rather than taken from prometheus-client: counters, a histogram and gauges read at
scrape time are all the service needs, and a sandbox node then installs one package fewer.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

Labels = tuple[tuple[str, str], ...]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Life-cycle operations run from ~5 ms (pause) to tens of seconds (a large checkpoint), in seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt_labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}" if items else ""


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _key(labels: dict[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


class Counter:
    """A monotonically increasing count per label set."""

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self._values: dict[Labels, float] = {}
        self._mu = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        k = _key(labels)
        with self._mu:
            self._values[k] = self._values.get(k, 0.0) + amount

    def render(self) -> list[str]:
        with self._mu:
            values = sorted(self._values.items())
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        return lines + [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in values]


class Histogram:
    """Cumulative buckets, sum and count per label set (`buckets` upper bounds, ascending)."""

    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help = name, help
        self.buckets = tuple(buckets)
        self._series: dict[Labels, list[float]] = {}  # per-bucket counts (+Inf last), then sum
        self._mu = threading.Lock()

    def observe(self, value: float, **labels: str) -> None:
        k = _key(labels)
        with self._mu:
            s = self._series.setdefault(k, [0.0] * (len(self.buckets) + 2))
            s[bisect.bisect_left(self.buckets, value)] += 1
            s[-1] += value

    def render(self) -> list[str]:
        with self._mu:
            series = sorted((k, list(s)) for k, s in self._series.items())
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for k, s in series:
            acc = 0.0
            for le, n in zip((*self.buckets, math.inf), s[:-1], strict=True):
                acc += n
                lines.append(f"{self.name}_bucket{_fmt_labels(k, (('le', _fmt_value(le)),))} {_fmt_value(acc)}")
            lines.append(f"{self.name}_sum{_fmt_labels(k)} {_fmt_value(s[-1])}")
            lines.append(f"{self.name}_count{_fmt_labels(k)} {_fmt_value(acc)}")
        return lines


class Gauge:
    """Values of one scrape: `{label set: value}` (label sets from `labels`)."""

    def __init__(self, name: str, help: str, values: dict[Labels, float]) -> None:
        self.name, self.help, self.values = name, help, values

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        return lines + [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in sorted(self.values.items())]


def render(metrics: Sequence[Counter | Histogram | Gauge]) -> str:
    """The exposition text of `metrics`, in order."""
    return "\n".join(line for m in metrics for line in m.render()) + "\n"


def labels(**kv: str) -> Labels:
    """A label set, as `Gauge` values are keyed."""
    return _key(kv)


class CountRequests:
    """ASGI middleware: count requests by method, route template and status."""

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def watch(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")  # set by the router on the shared scope once it matched
            self.counter.inc(method=scope["method"], route=getattr(route, "path", "unmatched"), status=str(status))
