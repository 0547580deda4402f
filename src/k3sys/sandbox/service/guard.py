"""Connection limits of the service's HTTP server: a bounded number of connections, a deadline for each
request's header, a bound on its size, and the process's descriptor limit raised to a known value.

uvicorn alone has none of the first three for a slow client: `limit_concurrency` answers 503 only
once a request's header is complete, and its keep-alive timer stops at the first byte, so a client
that opens connections and sends a header a byte at a time (slowloris) holds a descriptor each until
the process has none left. `guarded_protocol` returns uvicorn's own HTTP/1.1 protocol (h11) with the
missing checks, and `serve` passes it as uvicorn's `http` class; h11's state says exactly when a
connection waits for a request header (`their_state` IDLE), so the rules need no parsing of ours:

- at most `max_per_client` connections from one client address, and `max_connections` in all; a new
  one past either evicts the connection that has waited longest for a header (an idle keep-alive
  connection, or a slow or stalled header) from that client, or from anyone past the total. So one
  attacking address churns through its own share only and other clients keep being served (an
  attack from many addresses is held by the total and the header deadline, not more). If every
  connection that could go is inside a request, the new one gets a 503.
- a header not complete `header_timeout_s` after the connection opened (or, on a reused connection,
  after its first byte) closes the connection;
- a header over `max_header_bytes` is answered 431 with the service's error body (h11 would answer
  a bare 400 and log a warning per request).

A per-address share is the usual answer (nginx's limit_conn, Apache's mod_reqtimeout with
mod_qos); a switch to another server would not give it (hypercorn has no header-time limit either).
Evictions and timeouts are silent: logging each is what filled 23 MB of log under attack (see
`logfilter.py` for the rest). What no server process can do is keep a connect flood (thousands of
new connections a second) out of the kernel's accept queue, which it shares with every client:
that is a firewall's job (nftables meters, iptables connlimit/hashlimit), ahead of the service.
"""

from __future__ import annotations

import json
import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from k3sys.sandbox._wire import ERROR_HEADER, error_body
from k3sys.sandbox.errors import InvalidArgumentError, TooLargeError, UnavailableError
from k3sys.sandbox.spec import check_number

log = logging.getLogger("k3sys.sandbox.service")
NOFILE = 65536  # descriptors the service asks for (up to the hard limit)
RESERVE_FDS = 1024  # descriptors kept for everything but connections: runtime, agents, store, threads


@dataclass(frozen=True)
class ConnectionLimits:
    """`max_connections` open at once, `max_per_client` of them from one client address; a request
    header must be complete `header_timeout_s` seconds after it starts and be at most `max_header_bytes`."""

    max_connections: int = 4096
    header_timeout_s: float = 10.0
    max_per_client: int = 1024
    max_header_bytes: int = 64 << 10

    @property
    def backlog(self) -> int:
        """The listen backlog, which is also how many connections asyncio accepts in one go: with
        those not yet refused and those being closed, up to 3x it are open beyond `max_connections`."""
        return max(64, min(2048, self.max_connections // 4))

    def __post_init__(self) -> None:
        check_number("max_connections", self.max_connections, 16, 1 << 20, "connections", integer=True)
        check_number("max_per_client", self.max_per_client, 1, self.max_connections, "connections", integer=True)
        check_number("header_timeout_s", self.header_timeout_s, 0.1, 3600, "seconds")
        check_number("max_header_bytes", self.max_header_bytes, 1 << 10, 1 << 24, "bytes", integer=True)


def raise_nofile(limits: ConnectionLimits) -> int:
    """Raise this process's descriptor limit to `NOFILE` (or the hard limit, if lower) and check that
    `limits.max_connections` leaves `RESERVE_FDS` of it for the rest; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    need = limits.max_connections + 3 * limits.backlog + RESERVE_FDS
    if need > soft:
        raise InvalidArgumentError(f"max_connections: {limits.max_connections} connections + 3 x {limits.backlog} "
                                   f"being accepted or closed + {RESERVE_FDS} descriptors for the rest = {need} do "
                                   f"not fit the descriptor limit of {soft} (hard limit {hard}); lower it or raise "
                                   f"`ulimit -Hn`")
    return soft


def _raw_response(status: int, reason: str, exc: Exception) -> bytes:
    """A whole HTTP/1.1 answer with the service's error body, for when there is no app to answer."""
    err = error_body(exc, status)
    body = json.dumps(err).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{ERROR_HEADER}: {err['type']}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _Connections:
    """The open connections of one server, in all and per client address; `waiting`: those waiting for
    a request header, oldest first (in all, and per client)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open = 0
        self.by_client: dict[str, int] = {}
        self.waiting: OrderedDict[Any, None] = OrderedDict()
        self.waiting_by_client: dict[str, OrderedDict[Any, None]] = {}
        self.evicted = 0
        self.timed_out = 0
        self.busy = _raw_response(503, "Service Unavailable", UnavailableError(
            "the service (or this client's share of it) is at its connection limit, all inside requests: retry"))
        self.too_large = _raw_response(431, "Request Header Fields Too Large", TooLargeError(
            f"request header: more than {limits.max_header_bytes} bytes"))

    def make_room(self, client: str) -> bool:
        """Evict the connection waiting longest for a header, from `client` if it is past its share,
        else from anyone if the server is past its cap; False if room is needed and none can be made."""
        if self.by_client[client] > self.limits.max_per_client:
            pool = self.waiting_by_client.get(client)
        elif self.open > self.limits.max_connections:
            pool = self.waiting
        else:
            return True
        if not pool:
            return False
        self.evicted += 1
        next(iter(pool))._drop()
        return True

    def wait(self, proto: Any) -> None:
        self.waiting[proto] = None
        self.waiting.move_to_end(proto)
        mine = self.waiting_by_client.setdefault(proto.client_key, OrderedDict())
        mine[proto] = None
        mine.move_to_end(proto)

    def done(self, proto: Any) -> None:
        self.waiting.pop(proto, None)
        mine = self.waiting_by_client.get(proto.client_key)
        if mine is not None:
            mine.pop(proto, None)
            if not mine:
                del self.waiting_by_client[proto.client_key]


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with `limits` enforced over all its connections (module docstring)."""
    conns = _Connections(limits)

    class GuardedH11Protocol(H11Protocol):
        connections_state = conns  # for tests and metrics: counts of evictions and timeouts

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.client_key = self.client[0] if self.client else ""
            self._header_bytes, self._tail = 0, b""
            self._refused = False
            self._deadline: Any = None
            conns.open += 1
            conns.by_client[self.client_key] = conns.by_client.get(self.client_key, 0) + 1
            if not conns.make_room(self.client_key):  # all the others are inside requests: this one goes
                transport.write(conns.busy)
                transport.close()
                return
            self._await_header(start_clock=True)

        def _await_header(self, start_clock: bool) -> None:
            conns.wait(self)
            self._header_bytes, self._tail = 0, b""
            if start_clock and self._deadline is None:
                self._deadline = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _header_done(self) -> None:
            conns.done(self)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _drop(self) -> None:
            self._header_done()
            self.transport.abort()  # RST: nothing of a stalled header is worth a graceful close

        def _header_timeout(self) -> None:
            self._deadline = None
            if (self.conn.their_state is h11.IDLE or self._refused) and not self.transport.is_closing():
                conns.timed_out += 1
                self._drop()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # the rest of a refused header: read and dropped until the client closes
            if self.conn.their_state is h11.IDLE:
                if self._header_bytes == 0:  # a header starts (on a reused connection, its clock too)
                    self._await_header(start_clock=True)
                # Only the header counts: the same read may carry the start of the body.
                seen = self._tail + data
                end = seen.find(b"\r\n\r\n")
                self._header_bytes += len(data) if end < 0 else end + 4 - len(self._tail)
                self._tail = seen[-3:] if end < 0 else b""
                if self._header_bytes > limits.max_header_bytes:
                    # Answer, then half-close and keep reading: closing with unread bytes would send
                    # a reset that can destroy the answer before the client reads it. The header
                    # deadline (or an eviction) still ends the connection if the client lingers.
                    self._refused = True
                    self.transport.write(conns.too_large)
                    self.transport.write_eof()
                    return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._header_done()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                # Kept alive: evictable again; uvicorn's keep-alive timer bounds the idle wait.
                self._await_header(start_clock=False)

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_done()
            conns.open -= 1
            left = conns.by_client.pop(self.client_key) - 1
            if left:
                conns.by_client[self.client_key] = left
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """`uvicorn.run` keywords that put the guard in place (h11's own header bound sits above the
    guard's, so the guard, with its typed 431, answers first)."""
    return {"http": guarded_protocol(limits), "h11_max_incomplete_event_size": 2 * limits.max_header_bytes,
            "backlog": limits.backlog}
