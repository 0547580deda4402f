"""One client connection while it talks to sandboxes' ports: requests and responses pass through as
bytes (framing.py only measures them), exchange after exchange, on one upstream connection per
(sandbox, port) kept while the client keeps its own.

Per exchange: the request head is read (bounded), routed and checked (route.py); the head goes up
without the service's key, then the body as it comes; the response comes down untouched. A `101
Switching Protocols` (a WebSocket) joins the two connections for good. A head that is for no port
hands the connection back to uvicorn (`front`). Both directions are flow-controlled by asyncio's
write buffers (64 KiB): a side whose peer does not read stops being read, so a slow reader or an
endless response holds the sandbox's server back, never host memory. A checkpoint resets the
upstream connection (runtime/netns.py): an exchange cut mid-way ends the client's connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from k3sys.sandbox._wire import ERROR_HEADER
from k3sys.sandbox.service.ports.framing import (
    MAX_HEAD,
    Body,
    Head,
    HeadError,
    parse_head,
    request_body,
    response_body,
    status_of,
)
from k3sys.sandbox.service.ports.route import (
    Refusal,
    check_access,
    dial,
    ensure_running,
    forwarded,
    running,
    target,
)

# Bytes a side's transport may hold for a peer that does not read before the other side stops
# being read: per connection, twice (one each way), the proxy's whole buffering.
WRITE_BUFFER = 256 << 10
READ_SIZE = 1 << 20
_REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 431: "Request Header Fields Too Large",
            502: "Bad Gateway", 503: "Service Unavailable"}


class _Upstream(asyncio.Protocol):
    """The sandbox's side: its bytes go to the client connection."""

    def __init__(self, owner: PortConnection, key: tuple[str, int], release: Callable[[], None]) -> None:
        self.owner, self.key, self._release = owner, key, release
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER)
        if hasattr(transport, "max_size"):  # asyncio's selector transport reads 256 KiB at most: fewer, larger reads
            transport.max_size = READ_SIZE  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.owner.from_upstream(self, memoryview(data))

    def eof_received(self) -> bool:
        self.owner.upstream_ended(self)
        return False

    def pause_writing(self) -> None:
        self.owner.pause_client("upstream full")

    def resume_writing(self) -> None:
        self.owner.resume_client("upstream full")

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()
        self.owner.upstream_ended(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self._release()


class PortConnection(asyncio.Protocol):
    """The client's side (module docstring). `front`: the uvicorn protocol of this connection, parked
    while we hold it (its bookkeeping still counts the connection); `svc`: the Service."""

    def __init__(self, front: Any, svc: Any, idle_s: float) -> None:
        self.front, self.svc, self.idle_s = front, svc, idle_s
        self.transport: asyncio.Transport = front.transport
        self.buf = bytearray()  # client bytes not yet passed on (a head being read, or what follows)
        self.up: _Upstream | None = None
        self.state = "head"  # head -> opening -> exchange -> head ...; or tunnel; or closed
        self.method = b""
        self.req: Body | None = None
        self.resp: Body | None = None
        self.resp_head = bytearray()  # the response head being read
        self.paused: set[str] = set()
        self.close_after = False  # the client half-closed: end after this exchange
        self.up_close = False  # the server said `Connection: close`: a new upstream for the next one
        self.idle: asyncio.TimerHandle | None = None
        self.head_clock = False  # the header deadline runs (a head has started)
        self.upgrade = False  # the request under way asks for another protocol (a WebSocket)
        self.answered = False  # bytes of the answer to the request under way went to the client

    # --- the client's side ----------------------------------------------------------------------

    def start(self, first: bytes) -> None:
        self.transport.set_protocol(self)
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER)
        self.data_received(first)

    def data_received(self, data: bytes) -> None:
        if self.state == "tunnel":
            self._up_write(data)
            return
        if self.state == "exchange" and self.req is not None and not self.req.done and not self.buf:
            n = self.req.feed(memoryview(data))  # the usual path: body bytes straight up, uncopied
            self._up_write(data if n == len(data) else data[:n])
            if n < len(data):
                self.buf += data[n:]
            if self.req.done:
                self._progress()
            return
        self.buf += data
        self._progress()

    def _progress(self) -> None:
        """Move on with what the client sent: a request head, body bytes, or (between exchanges,
        pipelined) the next head, which waits until this exchange is over."""
        try:
            if self.state == "exchange" and self.req is not None and not self.req.done and self.buf:
                n = self.req.feed(memoryview(self.buf))
                self._up_write(bytes(self.buf[:n]))
                del self.buf[:n]
            if self.state == "exchange" and self.req is not None and self.req.done:
                if self.buf:
                    self.pause_client("pipelined")  # the next request waits for this answer
                if self.resp is not None and self.resp.done:
                    self._exchange_done()  # it was answered before its body was all sent
            if self.state == "head":
                self._read_head()
        except HeadError as e:
            self._refuse(Refusal(400, f"bad request framing: {e}", "invalid_argument"))

    def _read_head(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD:
                self._refuse(Refusal(431, f"request header: more than {MAX_HEAD} bytes", "too_large"))
            elif self.buf and not self.head_clock:  # a head started: the header deadline replaces the idle one
                self.head_clock = True
                self._arm(self.front.header_timeout_s)
            return
        head = parse_head(bytes(self.buf[:end]))
        body = request_body(head)  # a bad Content-Length is a 400 here, before anything goes up
        try:
            where = target(head.fields)
        except Refusal as r:
            return self._refuse(r)
        if where is None:  # for uvicorn: the connection goes back to it as it is
            return self._hand_back()
        self._disarm()
        self.head_clock = False
        self.method = head.first.split(b" ", 1)[0]
        rest = bytes(self.buf[end + 4:])
        self.buf.clear()
        self.state = "opening"
        self.pause_client("opening")
        try:
            check_access(self.svc, where[0], head.fields)
        except Refusal as r:
            return self._refuse(r)
        if self.up is not None and self.up.key == where and not self.up.closed and running(self.svc, where[0]):
            return self._begin(head, body, rest)  # kept alive, to the same port: no task, no wait
        asyncio.get_running_loop().create_task(self._open(where, head, body, rest))

    async def _open(self, where: tuple[str, int], head: Head, body: Body, rest: bytes) -> None:
        try:
            await ensure_running(self.svc, where[0])
            if self.up is not None and (self.up.key != where or self.up.closed):
                self.up.close()
                self.up = None
            if self.up is None:
                sock, release = await dial(self.svc, *where)
                up = _Upstream(self, where, release)
                try:
                    await asyncio.get_running_loop().create_connection(lambda: up, sock=sock)
                except OSError as e:
                    sock.close()
                    up.close()
                    raise Refusal(502, f"sandbox {where[0]} port {where[1]}: {e}", "port_unreachable") from None
                if self.state == "closed":
                    return up.close()
                self.up = up
        except Refusal as r:
            return self._refuse(r)
        except Exception as e:  # noqa: BLE001 (e.g. killed meanwhile): the client gets a 502 naming it
            why = Refusal(502, f"sandbox {where[0]} port {where[1]}: {e}", getattr(e, "code", "internal"))
            return self._refuse(why)
        if self.state != "closed":
            self._begin(head, body, rest)

    def _begin(self, head: Head, body: Body, rest: bytes) -> None:
        """Send the request head up (without the service's key) and let its body follow."""
        if self.up is None or self.up.closed:  # the kept connection closed as this request came
            return self._refuse(Refusal(502, "the sandbox's port closed the connection as the request came; retry",
                                        "port_unreachable"))
        self.upgrade = head.has_token(b"connection", b"upgrade") and b"upgrade" in head.fields
        self.req, self.resp, self.answered = body, None, False
        self.resp_head.clear()
        self.state = "exchange"
        self._up_write(b"\r\n".join([head.first, *forwarded(head.lines)]) + b"\r\n\r\n")
        self.buf[:0] = rest
        self.resume_client("opening")
        self._progress()

    def _hand_back(self) -> None:
        """A request for uvicorn: give it the connection (and these bytes), with nothing of ours left."""
        if self.up is not None:
            self.up.close()
            self.up = None
        self._disarm()
        self.state = "closed"
        data, self.buf = bytes(self.buf), bytearray()
        self.paused.clear()
        self.transport.resume_reading()
        self.transport.set_protocol(self.front)
        self.front.resume(data)

    def _refuse(self, r: Refusal) -> None:
        body = json.dumps({"code": r.status, "message": r.message, "type": r.type}).encode()
        head = (f"HTTP/1.1 {r.status} {_REASONS.get(r.status, 'Error')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{ERROR_HEADER}: {r.type}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.close()

    def eof_received(self) -> bool:
        if self.state == "tunnel" and self.up is not None and self.up.transport is not None:
            self.up.transport.write_eof()
            return True
        if self.state == "head" and not self.buf:
            return False
        self.close_after = True  # finish the exchange under way, then close
        return True

    def pause_writing(self) -> None:  # the client reads slower than the sandbox writes
        if self.up is not None and self.up.transport is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = "closed"
        self._disarm()
        if self.up is not None:
            self.up.close()
            self.up = None
        self.front.connection_lost(exc)  # uvicorn's and the guard's bookkeeping of this connection

    def close(self) -> None:
        self.state = "closed"
        self.transport.close()

    def pause_client(self, why: str) -> None:
        if not self.paused:
            self.transport.pause_reading()
        self.paused.add(why)

    def resume_client(self, why: str) -> None:
        self.paused.discard(why)
        if not self.paused and self.state != "closed":
            self.transport.resume_reading()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.idle = asyncio.get_running_loop().call_later(seconds, self.close)

    def _disarm(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None

    # --- the sandbox's side ---------------------------------------------------------------------

    def _up_write(self, data: bytes) -> None:
        if data and self.up is not None and self.up.transport is not None:
            self.up.transport.write(data)

    def from_upstream(self, up: _Upstream, data: memoryview) -> None:
        if up is not self.up or self.state not in ("exchange", "tunnel"):
            # Bytes nobody asked for (between exchanges): never passed on, where the client would
            # take them for the answer to its next request, which may be for envd or the control plane.
            if up is self.up:
                self.up = None
            return up.close()
        if self.state == "tunnel":
            self._down(data)
            return
        try:
            self._response_bytes(data)
        except HeadError as e:
            self._broken(f"sandbox {up.key[0]} port {up.key[1]} answered no valid HTTP response ({e})")

    def _response_bytes(self, view: memoryview) -> None:
        while view:
            if self.resp is None:  # reading a response head
                self.resp_head += view
                end = self.resp_head.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.resp_head) > MAX_HEAD:
                        raise HeadError(f"response head over {MAX_HEAD} bytes")
                    return
                raw = bytes(self.resp_head[:end + 4])
                view = memoryview(bytes(self.resp_head[end + 4:]))
                self.resp_head.clear()
                head = parse_head(raw[:-4])
                status = status_of(head)
                if status == 101 and not self.upgrade:
                    raise HeadError("101 Switching Protocols to a request that asked for no upgrade")
                resp = response_body(head, status, self.method)  # checked before any byte goes down
                self.answered = True
                self._down(raw)
                if status == 101:
                    self.state = "tunnel"
                    self.buf.clear()
                    self.resume_client("pipelined")
                    if view:
                        self._down(view)
                    return
                if 100 <= status < 200:
                    continue  # an interim answer (100 Continue): the real one follows
                self.resp = resp
                self.up_close = head.has_token(b"connection", b"close")
            n = self.resp.feed(view)
            if n:
                self._down(view[:n])
            view = view[n:]
            if self.resp.done:
                self._exchange_done()
                if view:  # the server said more than its answer: it no longer speaks HTTP to us
                    raise HeadError("bytes after the end of a response")
                return

    def _down(self, data: memoryview | bytes) -> None:
        self.transport.write(data)  # asyncio copies what it cannot send at once

    def _exchange_done(self) -> None:
        if self.req is not None and not self.req.done:
            return  # answered before the whole request arrived: the rest still goes up (`_progress`)
        if self.close_after:
            self.close()
            return
        if self.up_close and self.up is not None:
            self.up.close()
            self.up = None
        self.up_close = False
        self.state, self.req, self.resp = "head", None, None
        self._arm(self.idle_s)
        self.resume_client("pipelined")
        if self.buf:
            self._progress()

    def upstream_ended(self, up: _Upstream) -> None:
        if up is not self.up:
            return
        self.up = None
        if self.state == "exchange" and self.resp is not None and self.resp.until_close:
            self.close()  # the end of the connection was the end of the answer
        elif self.state == "exchange" and not self.answered:
            self._refuse(Refusal(502, f"sandbox {up.key[0]} port {up.key[1]} closed the connection "
                                      "without answering", "port_unreachable"))
        elif self.state in ("exchange", "tunnel"):
            self.close()  # cut mid-answer (a checkpoint, or the server died): the client must see it

    def _broken(self, why: str) -> None:
        if not self.answered:
            self._refuse(Refusal(502, why, "port_unreachable"))
        else:
            self.close()
        if self.up is not None:
            self.up.close()
            self.up = None

