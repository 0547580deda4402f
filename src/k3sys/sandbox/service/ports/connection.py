"""One client connection while it talks to sandboxes' ports: requests and responses pass through as
bytes (framing.py only measures them), exchange after exchange, on one upstream connection per
(sandbox, port) kept while the client keeps its own, and parked for the next client after
(upstream.py).

Per exchange: the request head is read (bounded), routed and checked (route.py); the head goes up
without the service's key, then the body as it comes; the response comes down untouched. A `101
Switching Protocols` (a WebSocket) joins the two connections for good. A head that is for no port
hands the connection back to uvicorn (`front`). Both directions are flow-controlled by asyncio's
write buffers (256 KiB): a side whose peer does not read stops being read, so a slow reader or an
endless response holds the sandbox's server back, never host memory. A checkpoint resets the
upstream connection (runtime/netns.py): an exchange cut mid-way ends the client's connection.
"""

from __future__ import annotations

import asyncio
import json
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
from k3sys.sandbox.service.ports.upstream import IDLE, WRITE_BUFFER, Upstream

_REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 431: "Request Header Fields Too Large",
            502: "Bad Gateway", 503: "Service Unavailable"}


class PortConnection(asyncio.Protocol):
    """The client's side (module docstring). `front`: the uvicorn protocol of this connection, parked
    while we hold it (its bookkeeping still counts the connection); `svc`: the Service."""

    def __init__(self, front: Any, svc: Any, idle_s: float) -> None:
        self.front, self.svc, self.idle_s = front, svc, idle_s
        self.transport: asyncio.Transport = front.transport
        self.buf = bytearray()  # client bytes not yet passed on (a head being read, or what follows)
        self.up: Upstream | None = None
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
        self.again: tuple[tuple[str, int], Head] | None = None  # the request under way, if it may go again

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
            return self._begin(where, head, body, rest)  # kept alive, to the same port: no task, no wait
        asyncio.get_running_loop().create_task(self._open(where, head, body, rest))

    async def _open(self, where: tuple[str, int], head: Head, body: Body, rest: bytes) -> None:
        try:
            await ensure_running(self.svc, where[0])
            if self.up is not None and (self.up.key != where or self.up.closed):
                self._let_go(idle=True)  # between exchanges: another client may use it
            if self.up is None:
                self.up = IDLE.take(where, self)
            if self.up is None:
                sock, release = await dial(self.svc, *where)
                up = Upstream(self, where, release)
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
            self._begin(where, head, body, rest)

    def _begin(self, where: tuple[str, int], head: Head, body: Body, rest: bytes) -> None:
        """Send the request head up (without the service's key) and let its body follow."""
        if self.up is None or self.up.closed:  # the kept connection closed as this request came: anew
            self.up = None
            self.state = "opening"
            asyncio.get_running_loop().create_task(self._open(where, head, body, rest))
            return
        # A request without a body on a connection that served before may go again on a new one if
        # the server closed this one as it came (an idle timeout): nothing of it was acted on.
        self.again = (where, head) if body.done and not rest and self.up.served else None
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
        self._let_go(idle=True)
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
        if self.state == "exchange" and self.req is not None and self.req.done:
            # The client left while its answer was due (its timeout, a closed page): nobody will read
            # the answer, so the exchange is abandoned and the upstream closed, which the server inside
            # sees (the code interpreter interrupts the run), as nginx does by default.
            self.close()
            return True
        self.close_after = True  # a request still arriving: finish the exchange under way, then close
        return True

    def pause_writing(self) -> None:  # the client reads slower than the sandbox writes
        if self.up is not None and self.up.transport is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._let_go(idle=self.state == "head")
        self.state = "closed"
        self._disarm()
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

    def from_upstream(self, up: Upstream, data: memoryview) -> None:
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

    def _let_go(self, idle: bool) -> None:
        """Give up the upstream connection: parked for the next client (`upstream.IDLE`) when it is
        `idle` (between exchanges) and its server keeps it open, else closed."""
        up, self.up = self.up, None
        if up is None:
            return
        if idle and not self.up_close and up.transport is not None:
            up.transport.resume_reading()  # parked, it must still see a close or a stray byte
            IDLE.park(up)
        else:
            up.close()

    def _down(self, data: memoryview | bytes) -> None:
        self.transport.write(data)  # asyncio copies what it cannot send at once

    def _exchange_done(self) -> None:
        if self.req is not None and not self.req.done:
            return  # answered before the whole request arrived: the rest still goes up (`_progress`)
        if self.close_after:
            self.close()
            return
        if self.up is not None:
            self.up.served = True
        if self.up_close and self.up is not None:
            self.up.close()
            self.up = None
        self.up_close = False
        self.state, self.req, self.resp = "head", None, None
        self._arm(self.idle_s)
        self.resume_client("pipelined")
        if self.buf:
            self._progress()

    def upstream_ended(self, up: Upstream) -> None:
        if up is not self.up:
            return
        self.up = None
        if self.state == "exchange" and self.resp is not None and self.resp.until_close:
            self.close()  # the end of the connection was the end of the answer
        elif self.state == "exchange" and not self.answered and self.again is not None:
            where, head = self.again
            self.again, self.state = None, "opening"
            self.pause_client("opening")
            asyncio.get_running_loop().create_task(self._open(where, head, request_body(head), b""))
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

