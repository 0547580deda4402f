"""One HTTP/1.1 exchange with a port inside a sandbox, for an ASGI request (route.py chose it).

The client's side is uvicorn's (keep-alive, chunked bodies, its flow control); the sandbox's side
is an h11 client connection over a socket made in the sandbox's namespace. The request body is
pumped up while the response is pumped down, both as they come, so a server that answers before
it read the whole body (or streams both ways) works, and nothing is held but one read (64 KiB)
per direction: uvicorn stops reading the client while its buffer is full, and `send` waits while
the client's socket is (a slow reader holds the sandbox's server back, not host memory).

Upstream connections are kept for reuse per (sandbox, port) while idle (`Pool`), each held by the
sandbox's gate like a fresh one (a checkpoint resets them; a reset idle one is dropped when next
taken). A request without a body whose reused connection turns out closed is sent again once on
a new one; a request with a body is not (its body was already read).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11

from k3sys.sandbox.service.ports.route import Refusal, close_quietly, dial, forwarded

READ_BYTES = 64 << 10
IDLE_S = 30.0  # an idle upstream connection older than this is closed rather than reused
MAX_IDLE = 256  # idle upstream connections kept, over all sandboxes and ports
# Hop-by-hop headers (RFC 9110 7.6.1): each side of the proxy has its own.
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                  b"upgrade", b"proxy-authorization", b"proxy-authenticate"})

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Upstream:
    """A connection to a port inside a sandbox: the socket (ours), the call that gives the gate's
    original back, and the h11 state of its exchanges."""

    def __init__(self, sock: socket.socket, release: Callable[[], None]) -> None:
        self.sock = sock
        self._release = release
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def alive(self) -> bool:
        """Whether an idle connection can carry another request (not reset, not closed by its server)."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return False  # closed (b""), or a server talking out of turn
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        close_quietly(self.sock)
        self._release()


class Pool:
    """Idle upstream connections by (sandbox, port), oldest evicted past MAX_IDLE."""

    def __init__(self) -> None:
        self._idle: OrderedDict[tuple[str, int], list[Upstream]] = OrderedDict()
        self._count = 0

    def take(self, key: tuple[str, int]) -> Upstream | None:
        conns = self._idle.get(key)
        while conns:
            up = conns.pop()
            self._count -= 1
            if time.monotonic() - up.idle_since < IDLE_S and up.alive():
                return up
            up.close()
        return None

    def put(self, key: tuple[str, int], up: Upstream) -> None:
        up.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(up)
        self._idle.move_to_end(key)
        self._count += 1
        while self._count > MAX_IDLE:
            old_key, conns = next(iter(self._idle.items()))
            conns.pop(0).close()
            self._count -= 1
            if not conns:
                del self._idle[old_key]

    def close(self) -> None:
        for conns in self._idle.values():
            for up in conns:
                up.close()
        self._idle.clear()
        self._count = 0


def _request(scope: MutableMapping[str, Any]) -> tuple[h11.Request, bool]:
    """The h11 request for an ASGI http scope, and whether it has a body."""
    headers = [(n, v) for n, v in forwarded(scope["headers"]) if n.lower() not in _HOP]
    names = {n.lower() for n, _ in scope["headers"]}
    body = b"content-length" in names or b"transfer-encoding" in names
    if body and b"content-length" not in names:
        headers.append((b"transfer-encoding", b"chunked"))  # uvicorn took the client's chunks apart
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    return h11.Request(method=scope["method"], target=target, headers=headers), body


async def _send_request(up: Upstream, req: h11.Request, body: bool, receive: Receive) -> bool:
    """Write the request and pump its body up; False if the client went away first."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(up.sock, up.h11.send(req))
    while body:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return False
        if msg.get("body"):
            await loop.sock_sendall(up.sock, up.h11.send(h11.Data(data=msg["body"])))
        body = msg.get("more_body", False)
    await loop.sock_sendall(up.sock, up.h11.send(h11.EndOfMessage()))
    return True


async def _next(up: Upstream) -> Any:
    loop = asyncio.get_running_loop()
    while (ev := up.h11.next_event()) is h11.NEED_DATA:
        up.h11.receive_data(await loop.sock_recv(up.sock, READ_BYTES))
    return ev


async def _relay_response(up: Upstream, send: Send, where: str) -> None:
    """Pump the response down. Refusal(502) if the server closed before it answered."""
    while True:
        try:
            ev = await _next(up)
        except (h11.RemoteProtocolError, OSError) as e:
            raise Refusal(502, f"{where} answered no valid HTTP response ({e})", "port_unreachable") from None
        if isinstance(ev, h11.ConnectionClosed):
            raise Refusal(502, f"{where} closed the connection without answering", "port_unreachable")
        if isinstance(ev, h11.Response):
            break  # (an InformationalResponse, 100 Continue, is not passed on: uvicorn sends its own)
    headers = [(n, v) for n, v in ev.headers.raw_items() if n.lower() not in _HOP]
    await send({"type": "http.response.start", "status": ev.status_code, "headers": headers})
    while True:
        ev = await _next(up)
        if isinstance(ev, h11.Data):
            await send({"type": "http.response.body", "body": bytes(ev.data), "more_body": True})
        elif isinstance(ev, h11.EndOfMessage):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        else:  # closed mid-body: the client must not take a cut body for a whole one
            raise ConnectionError(f"{where} closed the connection mid-response")


async def exchange(svc: Any, pool: Pool, sid: str, port: int, scope: MutableMapping[str, Any],
                   receive: Receive, send: Send) -> None:
    """Proxy one request to `port` of sandbox `sid` (access already checked)."""
    where = f"sandbox {sid} port {port}"
    req, body = _request(scope)
    for attempt in (0, 1):
        up = pool.take((sid, port)) if attempt == 0 else None
        reused = up is not None
        if up is None:
            up = Upstream(*await dial(svc, sid, port))
        ok = False
        try:
            pump = asyncio.ensure_future(_send_request(up, req, body, receive))
            try:
                await _relay_response(up, send, where)
            except Refusal:
                if reused and not body:
                    continue  # the server closed an idle connection as we sent: once more, anew
                raise
            finally:
                if not pump.done():
                    pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    sent = await pump
                    ok = bool(sent)
            ok = ok and up.h11.our_state is h11.DONE and up.h11.their_state is h11.DONE
            if ok:
                up.h11.start_next_cycle()
                pool.put((sid, port), up)
            return
        finally:
            if not ok:
                up.close()
