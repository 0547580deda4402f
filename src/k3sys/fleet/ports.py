"""A node's port relay: how the gateway reaches a port inside a sandbox on another machine.

The gateway's port proxy (sandbox/service/ports/) needs a connected byte stream to port P of
sandbox S. On a fleet, S lives on a node: the gateway asks that node (`open_port`, a Ray call) to
connect inside S's network namespace (`Runtime.open_socket`, held by S's checkpoint gate); the node
answers with its relay's address and a one-time ticket (32 random bytes, valid 10 s); the gateway
connects there and sends the ticket, and the relay joins the two connections, copying bytes both
ways (`join`: two threads, 64 KiB at a time: a slow side holds the other back). A connection without a
valid ticket is closed unread, so the relay's port opens nothing by itself. A checkpoint of S
resets the inside connection; the relay then closes the gateway's.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from k3sys.sandbox.errors import UnavailableError
from k3sys.sandbox.sdk.ports import join

TICKET_BYTES = 32
TICKET_S = 10.0  # how long a ticket waits for the gateway's connection
CONNECT_S = 10.0  # a listener inside that accepts nothing


class PortRelay:
    """The relay of one node (see the module docstring), listening on `host` (the node's address)."""

    def __init__(self, runtime: Any, host: str) -> None:
        self.runtime = runtime
        self._server = socket.create_server((host, 0))
        self.address = (host, self._server.getsockname()[1])
        self._waiting: dict[bytes, tuple[socket.socket, Callable[[], None], float]] = {}
        self._mu = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="k3sys-port-relay").start()

    def open(self, sid: str, port: int) -> tuple[str, int, bytes]:
        """Connect to `port` inside sandbox `sid`; (relay host, relay port, ticket) for the gateway.
        UnavailableError naming the port when nothing listens there."""
        for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            s, release = self.runtime.open_socket(sid, family)
            try:
                s.settimeout(CONNECT_S)
                s.connect((addr, port))
                s.settimeout(None)
                break
            except OSError:
                release()
        else:
            raise UnavailableError(f"sandbox {sid}: nothing listens on port {port} (connection refused)")
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._mu:
            self._expire()
            self._waiting[ticket] = (s, release, time.monotonic() + TICKET_S)
        return (*self.address, ticket)

    def _expire(self) -> None:
        now = time.monotonic()
        for t in [t for t, (_, _, end) in self._waiting.items() if end < now]:
            self._waiting.pop(t)[1]()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._join, args=(conn,), daemon=True).start()

    def _join(self, conn: socket.socket) -> None:
        conn.settimeout(TICKET_S)
        got = b""
        with contextlib.suppress(OSError):
            while len(got) < TICKET_BYTES and (piece := conn.recv(TICKET_BYTES - len(got))):
                got += piece
        with self._mu:
            self._expire()
            match = next((t for t in self._waiting if hmac.compare_digest(t, got)), None)
            inside = self._waiting.pop(match) if match is not None else None
        if inside is None:
            conn.close()
            return
        conn.settimeout(None)
        s, release, _ = inside
        join(conn, s)
        conn.close()
        release()

    def close(self) -> None:
        self._server.close()
        with self._mu:
            for _, release, _ in self._waiting.values():
                release()
            self._waiting.clear()

