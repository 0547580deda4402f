"""WebSocket upgrades to a port inside a sandbox: after the checks, bytes are spliced both ways.

uvicorn hands every `Upgrade: websocket` request, with its raw connection, to its `ws` protocol
class; `upgrade_protocol(app)` is ours. A request for a sandbox's port (route.py's rules) gets
its head passed on (without the service's key) to the port, and from then on the two connections
are joined: what one side sends the other is written, and each side stops reading while the other's
write buffer is full (asyncio's flow control, 64 KiB), so a slow peer holds the other back and the
host holds two buffers at most. The server inside answers the handshake itself (subprotocols,
extensions, its own 4xx). Any other upgrade goes to uvicorn's own WebSocket protocol unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.config import WS_PROTOCOLS
from uvicorn.importer import import_from_string

from k3sys.sandbox.service.ports.route import Refusal, check_access, dial, ensure_running, forwarded, target

MAX_HEAD = 64 << 10
log = logging.getLogger("k3sys.sandbox.service")


class _Upstream(asyncio.Protocol):
    """The sandbox's side of a splice: what it sends goes to the client."""

    def __init__(self, down: UpgradeProtocol) -> None:
        self.down = down

    def data_received(self, data: bytes) -> None:
        self.down.transport.write(data)

    def eof_received(self) -> bool:
        if self.down.transport.can_write_eof():
            self.down.transport.write_eof()
        return True  # half-closed: the client may still send

    def pause_writing(self) -> None:
        self.down.transport.pause_reading()

    def resume_writing(self) -> None:
        self.down.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.finish()


class UpgradeProtocol(asyncio.Protocol):
    """The client's side (see the module docstring); `app` is set by `upgrade_protocol`."""

    app: Any = None

    def __init__(self, config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> None:
        self.args = {"config": config, "server_state": server_state, "app_state": app_state}
        self.connections = server_state.connections
        self.head = bytearray()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.up: asyncio.Transport | None = None
        self.release: Callable[[], None] | None = None
        self.routed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)

    def shutdown(self) -> None:  # uvicorn's graceful shutdown
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.up is not None:
            self.up.write(data)
            return
        self.head += data
        if self.routed:
            return
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head) > MAX_HEAD:
                self.transport.close()
            return
        lines = bytes(self.head[:end]).split(b"\r\n")
        headers = [(n.strip().lower(), v.strip()) for n, _, v in (ln.partition(b":") for ln in lines[1:])]
        try:
            where = target(dict(headers))
        except Refusal as r:
            return self._refuse(r)
        if where is None:
            return self._to_uvicorn()
        self.routed = True
        self.transport.pause_reading()
        rest = bytes(self.head[end + 4:])
        self.head.clear()
        head = b"\r\n".join([lines[0], *(n + b": " + v for n, v in forwarded(headers))]) + b"\r\n\r\n"
        asyncio.get_running_loop().create_task(self._open(*where, dict(headers), head + rest))

    def _to_uvicorn(self) -> None:
        inner = import_from_string(WS_PROTOCOLS["auto"])(**self.args)
        self.connections.discard(self)
        inner.connection_made(self.transport)
        self.transport.set_protocol(inner)
        inner.data_received(bytes(self.head))

    async def _open(self, sid: str, port: int, headers: dict[bytes, bytes], first: bytes) -> None:
        svc = self.app.state.service
        try:
            check_access(svc, sid, headers)
            await ensure_running(svc, sid)
            sock, self.release = await dial(svc, sid, port)
        except Refusal as r:
            return self._refuse(r)
        except Exception as e:  # noqa: BLE001 (the client gets a 502 naming it; the service goes on)
            log.warning("upgrade to sandbox %s port %d failed: %r", sid, port, e)
            return self._refuse(Refusal(502, f"sandbox {sid} port {port}: {e}", "internal"))
        if self.transport.is_closing():  # the client left meanwhile
            sock.close()
            return self.finish()
        try:
            self.up, _ = await asyncio.get_running_loop().create_connection(lambda: _Upstream(self), sock=sock)
        except OSError as e:
            sock.close()
            return self._refuse(Refusal(502, f"sandbox {sid} port {port}: {e}", "port_unreachable"))
        self.up.write(first)
        self.transport.resume_reading()

    def _refuse(self, r: Refusal) -> None:
        body = json.dumps({"code": r.status, "message": r.message, "type": r.type}).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"k3sys-error-type: %s\r\nconnection: close\r\n\r\n%s"
                             % (r.status, _REASONS.get(r.status, b"Error"), len(body), r.type.encode(), body))
        self.transport.close()

    def pause_writing(self) -> None:
        if self.up is not None:
            self.up.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None:
            self.up.resume_reading()

    def eof_received(self) -> bool:
        if self.up is not None and self.up.can_write_eof():
            self.up.write_eof()
            return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.finish()

    def finish(self) -> None:
        """Close both sides and give the socket back to the sandbox's gate (once)."""
        self.connections.discard(self)
        self.transport.close()
        if self.up is not None:
            self.up.close()
        if self.release is not None:
            release, self.release = self.release, None
            release()


_REASONS = {400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found", 502: b"Bad Gateway",
            503: b"Service Unavailable"}


def upgrade_protocol(app: Any) -> type[UpgradeProtocol]:
    """uvicorn's `ws` class for the service application `app` (its `state.service`)."""
    return type("SandboxUpgradeProtocol", (UpgradeProtocol,), {"app": app})

