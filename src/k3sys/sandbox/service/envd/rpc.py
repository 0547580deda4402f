"""Connect RPC on the service's side: a method table, unary and server-stream answers, the request's
sandbox, user and deadline (the wire format itself is in `k3sys.sandbox._connect`).

Every handler gets an `Rpc`: the service, the sandbox id from `E2b-Sandbox-Id` (checked by app.py
before any handler runs), the user of `Authorization: Basic base64(user:)` (None: the agent's
default) and the request's message. A unary handler returns the answer's message; a stream handler
is an async generator of messages. Errors become Connect errors (unary: status + JSON body; stream:
the end-of-stream frame), with our error type alongside.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from k3sys.sandbox._connect import (
    ERROR_TYPE,
    STATUS,
    STREAM_CONTENT_TYPE,
    ConnectError,
    FrameReader,
    decode,
    end_frame,
    error_json,
    frame,
)
from k3sys.sandbox.errors import InvalidArgumentError, SandboxError, TooLargeError, UnavailableError
from k3sys.sandbox.runtime.templates import template_defaults
from k3sys.sandbox.service.core import Service

MAX_REQUEST = 4 << 20  # bytes of one request message (the SDK's own default read limit)


@dataclass
class EnvdState:
    """What envd keeps between calls (on `app.state.envd`): open output streams per (sandbox, pid),
    the watchers of CreateWatcher by id with their sandbox, the tenant of every watch held (kept or
    streamed), users' homes, and user and group names (with when they were read)."""

    streams: dict[tuple[str, int], int] = field(default_factory=dict)
    watchers: dict[str, Any] = field(default_factory=dict)  # watcher id -> filesystem.Watch
    watch_slots: dict[object, str | None] = field(default_factory=dict)  # a held watch's slot -> its tenant
    homes: dict[tuple[str, str | None], str] = field(default_factory=dict)  # (sandbox, user) -> home
    names: dict[str, tuple[float, dict[int, str], dict[int, str]]] = field(default_factory=dict)


MAX_HOMES = 4096  # (sandbox, user) homes (and sandboxes' id -> name tables) remembered, at most
NAMES_TTL_S = 30.0  # seconds a sandbox's user and group names are trusted before they are read again
_NAMES_MAX = 1 << 20  # bytes of /etc/passwd or /etc/group read, at most (the sandbox writes them)


def _id_names(svc: Service, sid: str, path: str) -> dict[int, str]:
    """id -> name from the sandbox's passwd-format file at `path` (read through its agent, bounded)."""
    try:
        with svc.rt.open_file(sid, path) as f:
            text = f.read(_NAMES_MAX).decode("utf-8", "replace")
    except SandboxError:
        return {}
    out: dict[int, str] = {}
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2].isdigit():
            out.setdefault(int(fields[2]), fields[0])
    return out


async def names(svc: Service, state: EnvdState, sid: str) -> tuple[dict[int, str], dict[int, str]]:
    """The sandbox's (users, groups) by id, read again after `NAMES_TTL_S`."""
    now = time.monotonic()
    cached = state.names.get(sid)
    if cached is None or now - cached[0] > NAMES_TTL_S:
        users = await svc.call("envd.names", _id_names, svc, sid, "/etc/passwd", io=True)
        groups = await svc.call("envd.names", _id_names, svc, sid, "/etc/group", io=True)
        if len(state.names) >= MAX_HOMES:
            state.names.clear()
        cached = state.names[sid] = (now, users, groups)
    return cached[1], cached[2]


def _home(svc: Service, sid: str, user: str | None) -> str:
    """`user`'s home in the sandbox ($HOME as the agent sets it for the user)."""
    result = svc.rt.wait_command(svc.rt.start_process(sid, "cd && pwd", "/", {}, user), 10)
    home = result.stdout.strip()[:4096] if result.exit_code == 0 else ""
    return home if home.startswith("/") else "/"


async def home(svc: Service, state: EnvdState, sid: str, user: str | None) -> str:
    """`user`'s home in sandbox `sid`, asked once per sandbox and user (through the agent)."""
    found = state.homes.get((sid, user))
    if found is None:
        found = await svc.call("envd.home", _home, svc, sid, user, io=True)
        if len(state.homes) >= MAX_HOMES:
            state.homes.clear()
        state.homes[(sid, user)] = found
    return found


async def absolute(svc: Service, state: EnvdState, sid: str, user: str | None, path: str) -> str:
    """`path` made absolute as envd does: a relative one starts at the template's workdir (E2B's
    `set_workdir`, a Dockerfile's WORKDIR: envd's default workdir), else at the user's home."""
    if not isinstance(path, str) or path.startswith("/") or not path:
        return path  # the runtime checks what is left
    base = template_defaults(svc.rt.info(sid).spec.template).cwd or await home(svc, state, sid, user)
    return f"{base.rstrip('/')}/{path}"


@dataclass
class Rpc:
    """One call: the service, its sandbox, the user it runs as, the message, the `timeout_s` asked
    by `Connect-Timeout-Ms` and when it must end (`deadline`, monotonic seconds; None: never)."""

    svc: Service
    sid: str
    user: str | None
    msg: dict[str, Any]
    timeout_s: float | None
    deadline: float | None
    keepalive_s: float | None
    state: EnvdState
    headers: Mapping[str, str]


Unary = Callable[[Rpc], Awaitable[dict[str, Any]]]
Stream = Callable[[Rpc], AsyncIterator[dict[str, Any]]]


def user_of(authorization: str | None) -> str | None:
    """The user of an `Authorization: Basic base64("user:")` header (None without one)."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None  # a bearer key for the control plane names no user
    try:
        user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise InvalidArgumentError(f"authorization: not base64 of `user:`: {value[:40]!r}") from None
    return user or None


def _number_header(request: Request, name: str, scale: float) -> float | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise InvalidArgumentError(f"{name}: expected a number, got {raw[:20]!r}") from None
    return v * scale if v > 0 else None


async def _read_body(request: Request, streamed: bool) -> dict[str, Any]:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REQUEST + 5:
            raise TooLargeError(f"connect request: more than {MAX_REQUEST} bytes")
    if not streamed:
        return decode(bytes(body))
    reader = FrameReader(MAX_REQUEST)
    messages = [m for _, m in reader.feed(bytes(body))]
    if reader.pending or len(messages) != 1:
        raise InvalidArgumentError(f"connect stream request: expected one whole message, got {len(messages)}")
    return messages[0]


async def _rpc(request: Request, streamed: bool, read: bool = True) -> Rpc:
    timeout = _number_header(request, "connect-timeout-ms", 1e-3)
    return Rpc(svc=request.app.state.service, sid=request.headers["e2b-sandbox-id"],
               user=user_of(request.headers.get("authorization")),
               msg=await _read_body(request, streamed) if read else {},
               timeout_s=timeout, deadline=None if timeout is None else time.monotonic() + timeout,
               keepalive_s=_number_header(request, "keepalive-ping-interval", 1.0), state=request.app.state.envd,
               headers=request.headers)


def error_response(exc: BaseException) -> JSONResponse:
    """A unary Connect error answer (our error type in a header)."""
    err, kind = error_json(exc)
    return JSONResponse(err, status_code=STATUS.get(err["code"], 500), headers={ERROR_TYPE: kind} if kind else {})


def unary(handler: Unary) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return JSONResponse(await handler(await _rpc(request, streamed=False)))
        except Exception as e:  # every failure is an answer of the protocol
            return error_response(e)
    return endpoint


def server_stream(handler: Stream) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            rpc = await _rpc(request, streamed=True)
        except Exception as e:
            return _stream_response(_only_end(e))
        return _stream_response(_frames(handler(rpc)))
    return endpoint


def client_stream(handler: Callable[[Rpc, AsyncIterator[dict[str, Any]]], Awaitable[dict[str, Any]]]
                  ) -> Callable[[Request], Awaitable[Response]]:
    """A client-streaming method: `handler(rpc, messages)` gets the request's frames as they arrive
    and returns the one answer, sent as a stream of one message and the end frame."""
    async def endpoint(request: Request) -> Response:
        async def messages() -> AsyncIterator[dict[str, Any]]:
            reader = FrameReader(MAX_REQUEST)
            async for chunk in request.stream():
                for flags, msg in reader.feed(chunk):
                    if not flags & 0x02:
                        yield msg
            if reader.pending:
                raise InvalidArgumentError("connect stream request: cut off inside a frame")

        async def one() -> AsyncIterator[bytes]:
            try:
                answer = await handler(await _rpc(request, streamed=True, read=False), messages())
            except Exception as e:
                yield end_frame(e)
                return
            yield frame(answer)
            yield end_frame()
        return _stream_response(one())
    return endpoint


class SandboxGoneError(UnavailableError):
    """A stream's sandbox was killed under it: the stream is cut, not ended (`_CutOnGone`)."""


class _CutOnGone(StreamingResponse):
    """A Connect stream that a `SandboxGoneError` cuts: the connection closes mid-body, without the
    end frame, as E2B's proxy drops it when the sandbox dies. Both E2B SDKs then probe /health (502:
    gone) and report the kill; the JS SDK probes only on a dropped connection ("terminated"), so an
    end frame saying `unavailable` made it report a sandbox timeout instead."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except SandboxGoneError:
            return  # the server closes a response left incomplete (uvicorn logs one line)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _stream_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return _CutOnGone(body, media_type=STREAM_CONTENT_TYPE)


async def _only_end(exc: BaseException) -> AsyncIterator[bytes]:
    yield end_frame(exc)


async def _frames(messages: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for msg in messages:
            yield frame(msg)
    except SandboxGoneError:
        raise  # no end frame: the connection is cut
    except Exception as e:
        yield end_frame(e)
        return
    yield end_frame()


def cap_deadline(rpc: Rpc) -> None:
    """Bound a command's stream by the service's command timeout cap (InvalidArgumentError when
    the call asks for longer; the cap when it asks for no limit)."""
    rpc.deadline = time.monotonic() + rpc.svc.cap_timeout(rpc.timeout_s)


def past_deadline(rpc: Rpc) -> ConnectError | None:
    """The error a stream ends with once its `Connect-Timeout-Ms` has passed (else None)."""
    if rpc.deadline is not None and time.monotonic() > rpc.deadline:
        return ConnectError("deadline_exceeded", "the call ran past its Connect-Timeout-Ms")
    return None


def selector_pid(msg: dict[str, Any], field: str = "process") -> int:
    """The pid of a `ProcessSelector` (selecting by tag is not supported: the agent has no tags of
    the client's)."""
    sel = msg.get(field) or {}
    pid = sel.get("pid") if isinstance(sel, dict) else None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        if isinstance(sel, dict) and "tag" in sel:
            raise ConnectError("unimplemented", f"{field}: selecting a process by tag is not supported")
        raise InvalidArgumentError(f"{field}: expected {{\"pid\": <positive integer>}}, got {sel!r}")
    return pid
