"""Live slots: at most `cap` sandboxes hold memory (running, paused, or being hibernated) at once.

An episode that needs its sandbox live and finds every slot taken evicts idle episodes (their
policy is thinking) by hibernating them, the most recently idled first: with think times drawn
alike, that one has the longest wait still ahead. Eviction happens only when it satisfies the whole
request at once, so requests never half-fill and block each other; a resident episode waiting for
more slots (a fork's children) counts as idle meanwhile, so two forking episodes cannot deadlock.
`cap=None` keeps the counts without ever blocking.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable


class Slots:
    """Slot bookkeeping; `evict(key)` hibernates an idle episode's sandbox (called without the lock)."""

    def __init__(self, cap: int | None, evict: Callable[[Hashable], None]) -> None:
        self.cap = cap
        self._evict = evict
        self._cv = threading.Condition()
        self._resident: set[Hashable] = set()
        self._idle: dict[Hashable, float] = {}  # resident and evictable -> when it went idle
        self._evicting: set[Hashable] = set()
        self._reserved = 0
        self.peak = 0  # most slots in use at once

    def _used(self) -> int:
        return len(self._resident) + self._reserved

    def acquire(self, key: Hashable, now: Callable[[], float], extra: int = 0) -> None:
        """Block until `key` holds a slot, plus `extra` reserved ones for sandboxes it is about to
        create (hand each to its owner with `grant`). May evict idle episodes first."""
        victims: list[Hashable] = []
        with self._cv:
            while True:
                if key in self._evicting:  # our own sandbox is being hibernated: wait for it
                    self._cv.wait()
                    continue
                need = extra + (key not in self._resident)
                free = self.cap - self._used() if self.cap is not None else need
                if need <= free:
                    break
                idle = sorted((k for k in self._idle if k != key and k not in self._evicting),
                              key=self._idle.__getitem__, reverse=True)
                if free + len(idle) >= need:
                    victims = idle[:need - free]
                    for v in victims:
                        self._evicting.add(v)
                        self._resident.discard(v)
                        del self._idle[v]
                    break
                if key in self._resident:  # others may evict us while we wait for more
                    self._idle[key] = now()
                self._cv.wait()
                self._idle.pop(key, None)
            self._idle.pop(key, None)
            self._resident.add(key)
            self._reserved += extra
            self.peak = max(self.peak, self._used())
        if victims:
            try:
                for v in victims:
                    self._evict(v)
            finally:
                with self._cv:
                    self._evicting.difference_update(victims)
                    self._cv.notify_all()

    def grant(self, key: Hashable) -> None:
        """Give one reserved slot to `key`."""
        with self._cv:
            self._reserved -= 1
            self._resident.add(key)

    def unreserve(self, n: int) -> None:
        with self._cv:
            self._reserved -= n
            self._cv.notify_all()

    def set_idle(self, key: Hashable, when: float | None) -> None:
        """Mark `key` evictable since `when` (None: busy again, or about to be hibernated by its owner)."""
        with self._cv:
            if when is None:
                self._idle.pop(key, None)
            elif key in self._resident:
                self._idle[key] = when
                self._cv.notify_all()

    def release(self, key: Hashable) -> None:
        """`key`'s sandbox holds no memory any more (hibernated or killed)."""
        with self._cv:
            self._resident.discard(key)
            self._idle.pop(key, None)
            self._cv.notify_all()
