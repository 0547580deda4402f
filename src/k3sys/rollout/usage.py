"""Resource accounting from cgroup counters: CPU-seconds and resident GB-seconds held by sandboxes.

A background thread reads every tracked sandbox's memory charge (`Sandbox.memory_bytes`: cgroup v1
memory.usage_in_bytes / v2 memory.current) and CPU counter (`Sandbox.cpu_seconds`: cpuacct.usage /
cpu.stat usage_usec) every `interval_s`, and integrates:

- memory: sample and hold, each reading counts until the next (GB-seconds, GB = 1e9 bytes);
- CPU: the sum of counter increases. A hibernated sandbox comes back in a new cgroup whose counter
  starts at 0, so a reading below the previous one starts a new count instead of going negative.
  The engine reads (`sample`) right before it removes a cgroup (hibernate, kill) with the sandbox
  frozen, so what the old cgroup charged is all counted. What CRIU's parasite code charges to the
  frozen cgroup during a dump after that reading is lost with the cgroup (a few ms per dump).

A hibernated sandbox reads 0 bytes: its memory is in the checkpoint store, on disk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from k3sys.sandbox.errors import InvalidArgumentError, SandboxError
from k3sys.sandbox.sdk.api import Sandbox


@dataclass
class Usage:
    """What one sandbox has held so far; `series` is its memory samples as (instant s, bytes)."""

    cpu_s: float = 0.0
    byte_s: float = 0.0
    peak_bytes: int = 0
    series: list[tuple[float, int]] = field(default_factory=list)
    last_t: float | None = None
    last_bytes: int = 0
    last_cpu: float = 0.0

    @property
    def mem_gb_s(self) -> float:
        return self.byte_s / 1e9


class UsageSampler:
    """Samples tracked sandboxes every `interval_s` seconds on a daemon thread; instants are seconds
    on `clock` minus `t0`. `totals` holds, per tick, (instant, bytes held by all tracked sandboxes)."""

    def __init__(self, interval_s: float = 0.05, t0: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(interval_s, int | float) or not 1e-3 <= interval_s <= 10:
            raise InvalidArgumentError(f"interval_s must be in [0.001, 10] seconds, got {interval_s!r}")
        self.interval_s, self.t0, self.clock = float(interval_s), t0, clock
        self.usage: dict[str, Usage] = {}
        self.totals: list[tuple[float, int]] = []
        self._sandboxes: dict[str, Sandbox] = {}
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="k3sys-rollout-usage", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def track(self, key: str, sbx: Sandbox) -> None:
        """Start accounting `sbx` under `key` (taking a first reading now)."""
        with self._mu:
            self._sandboxes[key] = sbx
            self.usage.setdefault(key, Usage())
            self._read(key, self.clock() - self.t0)

    def sample(self, key: str) -> None:
        """Read `key`'s counters now (before its cgroup goes away)."""
        with self._mu:
            if key in self._sandboxes:
                self._read(key, self.clock() - self.t0)

    def untrack(self, key: str) -> Usage:
        """Take a last reading and stop accounting `key`; returns its usage."""
        with self._mu:
            if key in self._sandboxes:
                self._read(key, self.clock() - self.t0)
                del self._sandboxes[key]
            return self.usage[key]

    def _read(self, key: str, t: float) -> int:
        sbx, u = self._sandboxes[key], self.usage[key]
        try:
            mem, cpu = sbx.memory_bytes(), sbx.cpu_seconds()
        except SandboxError:  # killed under us: it holds nothing
            mem, cpu = 0, u.last_cpu
        if u.last_t is not None:
            u.byte_s += u.last_bytes * (t - u.last_t)
        u.cpu_s += cpu - u.last_cpu if cpu >= u.last_cpu else cpu
        u.last_t, u.last_bytes, u.last_cpu = t, mem, cpu
        u.peak_bytes = max(u.peak_bytes, mem)
        u.series.append((t, mem))
        return mem

    def _loop(self) -> None:
        next_tick = self.clock()
        while not self._stop.is_set():
            with self._mu:
                t = self.clock() - self.t0
                self.totals.append((t, sum(self._read(k, t) for k in list(self._sandboxes))))
            next_tick += self.interval_s
            self._stop.wait(max(0.0, next_tick - self.clock()))
