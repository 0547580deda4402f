"""The sandbox's side of the port proxy: one connection to a port inside a sandbox (`Upstream`),
and the connections kept idle between clients (`IDLE`).

An upstream connection serves one client connection at a time (its `owner`, connection.py). When
that client goes, or its next request is for another port or for the service itself, an upstream
connection between exchanges is parked in `IDLE` (at most `MAX_IDLE`, each at most `IDLE_S`), and
the next client connection to the same (sandbox, port) takes it instead of making a new one (a
worker thread, setns and a connect: ~1-2 ms here). Parked, it is still held by the sandbox's gate (a
checkpoint resets it, which drops it from the pool); a byte it sends while parked, which nobody
asked for, drops it too. As any reverse proxy that keeps upstream connections (nginx's `keepalive`),
this shares a connection between clients: a server that ties authentication to its TCP connection
rather than to each request would see them as one.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

# Bytes a side's transport may hold for a peer that does not read before the other side stops
# being read: per connection, twice (one each way), the proxy's whole buffering.
WRITE_BUFFER = 256 << 10
READ_SIZE = 1 << 20
MAX_IDLE = 64  # parked connections, over all sandboxes and ports
IDLE_S = 30.0  # a parked connection older than this is closed, not reused


class Owner(Protocol):
    """What an upstream connection tells the client connection it serves (connection.py)."""

    def from_upstream(self, up: Upstream, data: memoryview) -> None: ...

    def upstream_ended(self, up: Upstream) -> None: ...

    def pause_client(self, why: str) -> None: ...

    def resume_client(self, why: str) -> None: ...


class Upstream(asyncio.Protocol):
    """A connection to port `key[1]` of sandbox `key[0]`; `release` gives its socket back to the
    sandbox's gate once closed."""

    def __init__(self, owner: Owner | None, key: tuple[str, int], release: Callable[[], None]) -> None:
        self.owner, self.key, self._release = owner, key, release
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.served = False  # it carried a whole exchange (so a close before an answer may be an idle timeout)
        self.parked_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER)
        if hasattr(transport, "max_size"):  # asyncio's selector transport reads 256 KiB at most: fewer, larger reads
            transport.max_size = READ_SIZE  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.owner is None:  # parked: nobody asked
            return self.close()
        self.owner.from_upstream(self, memoryview(data))

    def eof_received(self) -> bool:
        if self.owner is not None:
            self.owner.upstream_ended(self)
        return False

    def pause_writing(self) -> None:
        if self.owner is not None:
            self.owner.pause_client("upstream full")

    def resume_writing(self) -> None:
        if self.owner is not None:
            self.owner.resume_client("upstream full")

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()
        if self.owner is not None:
            self.owner.upstream_ended(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            IDLE.forget(self)
            if self.transport is not None:
                self.transport.close()
            self._release()


class IdlePool:
    """Parked upstream connections, oldest first (see the module docstring)."""

    def __init__(self) -> None:
        self._idle: OrderedDict[Upstream, None] = OrderedDict()

    def park(self, up: Upstream) -> None:
        if up.closed:
            return
        up.owner, up.parked_at = None, time.monotonic()
        self._idle[up] = None
        while len(self._idle) > MAX_IDLE:
            next(iter(self._idle)).close()

    def take(self, key: tuple[str, int], owner: Owner) -> Upstream | None:
        """A parked connection to `key` (the newest), now `owner`'s; None if there is none."""
        now = time.monotonic()
        for up in reversed(list(self._idle)):
            if now - up.parked_at > IDLE_S:
                up.close()
            elif up.key == key:
                del self._idle[up]
                up.owner = owner
                return up
        return None

    def forget(self, up: Upstream) -> None:
        self._idle.pop(up, None)


IDLE = IdlePool()
