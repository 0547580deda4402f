"""Clients of the sandbox service (`server.py`): `HTTPBackend`, a `Backend` over httpx, so

    Sandbox.create(api_url="http://127.0.0.1:8765", api_key=...)    # or K3SYS_API_URL / K3SYS_API_KEY

gives a sandbox whose every call goes over HTTP and raises what the embedded runtime raises (the
status mapping is `_wire.error_of`). `AsyncHTTPBackend` makes the same calls as coroutines.

The two are siblings (httpx's shape), neither a subclass of the other: `_Routes` describes each
request once (`_Call`) and hands it to `_do`, which `HTTPBackend` performs with `httpx.Client` and
`AsyncHTTPBackend` as a coroutine over `httpx.AsyncClient`. Each has only its own kind of method
(`close` / `aclose`, `with` / `async with`). Connections are pooled and reused; `connect` keeps one
blocking client per (url, key) per process, `aconnect` one async client per (url, key) per event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from k3sys.sandbox._connect import STREAM_CONTENT_TYPE, UNARY_CONTENT_TYPE, frame, http_error_of
from k3sys.sandbox._envd import (
    API_KEY_HEADER,
    ENVD_PORT,
    KEEP_HEADER,
    KILL_HEADER,
    PORT_HEADER,
    SANDBOX_HEADER,
    ProcessStream,
)
from k3sys.sandbox._wire import checkpoint_info, error_of, sandbox_info
from k3sys.sandbox.errors import InvalidArgumentError, SandboxError, UnavailableError
from k3sys.sandbox.sdk.backend import AsyncBackend
from k3sys.sandbox.sdk.envd_calls import EnvdCalls, rooted, split_cid, texts
from k3sys.sandbox.sdk.envd_calls import no_answer as _none
from k3sys.sandbox.spec import MAX_FORK, CommandResult, OutputPieces, SandboxSpec, check_number
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo

DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)  # life-cycle calls (a fork of many) may take minutes
_MARGIN = 30.0  # extra seconds the HTTP read waits beyond a command's own timeout


@dataclass(frozen=True)
class _Call:
    """One request: what to send, how to read the answer (`parse` also sees error answers when `raw`).
    `timeout` in seconds, None for none; by default the client's."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    content: bytes | Iterable[bytes] | None = None
    parse: Callable[[httpx.Response], Any] = _none
    timeout: Any = httpx.USE_CLIENT_DEFAULT
    raw: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    errors: Callable[[int, bytes, Any], SandboxError] = error_of  # (status, body, headers) -> the exception
    paged: bool = False  # a list: `_do` asks for the next page while the answer names one, and joins them


def _command_timeout(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + _MARGIN


_STREAM_TIMEOUT = httpx.Timeout(None, connect=10.0)  # a quiet command may send nothing for long


class _Routes(EnvdCalls):
    """The sandbox service's routes, each described once; `_do` (the sibling's) performs the request,
    so each returns its answer in `HTTPBackend` and a coroutine of it in `AsyncHTTPBackend`.

    `api_key` defaults to `K3SYS_API_KEY`; `timeout` (seconds, or an httpx.Timeout) bounds every call
    but commands, which wait their own timeout plus a margin.
    """

    def __init__(self, api_url: str, api_key: str | None = None,
                 timeout: httpx.Timeout | float = DEFAULT_TIMEOUT, max_connections: int = 100) -> None:
        if not isinstance(api_url, str) or not api_url.startswith(("http://", "https://")):
            raise InvalidArgumentError(f"api_url: expected an http(s) URL, got {api_url!r}")
        self.api_url = api_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("K3SYS_API_KEY")
        headers = {"x-api-key": self.api_key} if self.api_key else {}
        # Idle connections expire long before the server closes them (server.KEEP_ALIVE_S): a request
        # never goes out on a connection the server is closing.
        self._http = self._client(base_url=self.api_url, headers=headers, timeout=timeout,
                                  limits=httpx.Limits(max_connections=max_connections,
                                                      max_keepalive_connections=max_connections, keepalive_expiry=5.0))

    def _client(self, **kw: Any) -> Any:
        raise NotImplementedError

    def _do(self, call: _Call) -> Any:
        raise NotImplementedError

    def _request(self, call: _Call) -> httpx.Request:
        return self._http.build_request(call.method, call.path, params=call.params, json=call.json,
                                        content=call.content, headers=call.headers, timeout=call.timeout)

    def _next_page(self, call: _Call, r: httpx.Response) -> _Call | None:
        """The request for the page after `r` when `call` is a list with more (E2B's X-Next-Token)."""
        token = r.headers.get("x-next-token") if call.paged and r.status_code < 400 else None
        return dataclasses.replace(call, params={**(call.params or {}), "nextToken": token}) if token else None

    def _answer(self, call: _Call, r: httpx.Response) -> Any:
        if r.status_code >= 400 and not call.raw:
            raise call.errors(r.status_code, r.content, r.headers)
        return call.parse(r)

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        """httpx's transport errors (refused, reset, timed out) as the SDK's UnavailableError."""
        try:
            yield
        except httpx.TransportError as e:
            raise UnavailableError(f"sandbox service at {self.api_url}: {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.api_url!r})"

    # --- sandboxes ------------------------------------------------------------------------------

    def create(self, spec: SandboxSpec, id: str | None = None) -> SandboxInfo:
        body = {"templateID": spec.template, "timeout": spec.timeout_s, "sandboxID": id, "cpu": spec.cpu,
                "memoryMB": spec.memory_mb, "diskSizeMB": spec.disk_mb, "pids": spec.pids,
                "allow_internet_access": spec.network, "metadata": spec.metadata, "envVars": spec.envs}
        if spec.egress is not None:
            e = spec.egress
            body["network"] = {"allowOut": list(e.allow_out), "denyOut": list(e.deny_out)} | (
                {} if e.dns_servers is None else {"dnsServers": list(e.dns_servers)})
        if spec.on_timeout is not None:  # omitted: the service's default
            body["autoPause"] = spec.on_timeout == "hibernate"
        return self._do(_Call("POST", "/v2/sandboxes", json=body, parse=lambda r: sandbox_info(r.json())))

    def info(self, sid: str) -> SandboxInfo:
        return self._do(_Call("GET", f"/sandboxes/{sid}", parse=lambda r: sandbox_info(r.json())))

    def list(self) -> list[SandboxInfo]:
        """Every sandbox, every state, oldest first (every page)."""
        return self._do(_Call("GET", "/v2/sandboxes", params={"order": "asc"},
                              parse=lambda r: [sandbox_info(d) for d in r.json()], paged=True))

    def kill(self, sid: str) -> None:
        return self._do(_Call("DELETE", f"/sandboxes/{sid}"))

    def set_timeout(self, sid: str, timeout_s: float) -> None:
        return self._do(_Call("POST", f"/sandboxes/{sid}/timeout", json={"timeout": timeout_s}))

    def memory_bytes(self, sid: str) -> int:
        return self._do(_Call("GET", f"/sandboxes/{sid}/memory", parse=lambda r: r.json()["bytes"]))

    def cpu_seconds(self, sid: str) -> float:
        return self._do(_Call("GET", f"/sandboxes/{sid}/cpu", parse=lambda r: r.json()["seconds"]))

    # --- commands and files: envd's protocol (_envd.py), routed by the sandbox's id ------------

    def _envd(self, sid: str, method: str, msg: dict[str, Any], parse: Callable[[httpx.Response], Any],
              stream: bool = False, headers: dict[str, str] | None = None, timeout: Any = httpx.USE_CLIENT_DEFAULT,
              raw: bool = False) -> Any:
        """A Connect call of envd (`method`: "process.Process/Start"): unary, or a server stream
        whose whole body `parse` reads."""
        h = {SANDBOX_HEADER: sid, PORT_HEADER: str(ENVD_PORT), "content-type": STREAM_CONTENT_TYPE if stream
             else UNARY_CONTENT_TYPE, **({API_KEY_HEADER: self.api_key} if self.api_key else {}), **(headers or {})}
        body = frame(msg) if stream else json.dumps(msg).encode()
        return self._do(_Call("POST", f"/{method}", content=body, headers=h, parse=parse, timeout=timeout, raw=raw,
                              errors=http_error_of))

    def _connect_stream(self, cid: str) -> tuple[str, str, dict[str, Any]]:
        """(method, url, keyword arguments) of `stream_command`'s request: a Connect stream that keeps
        the ended process's record for `wait_command`."""
        sid, pid = split_cid(cid)
        headers = {SANDBOX_HEADER: sid, PORT_HEADER: str(ENVD_PORT), "content-type": STREAM_CONTENT_TYPE,
                   KEEP_HEADER: "1", **({API_KEY_HEADER: self.api_key} if self.api_key else {})}
        return "POST", "/process.Process/Connect", {"content": frame({"process": {"pid": pid}}), "headers": headers,
                                                    "timeout": _STREAM_TIMEOUT}

    def _read_stream(self, sid: str, path: str, user: str | None) -> httpx.Request:
        """`read_stream`'s request: envd's GET /files, its body read as it arrives."""
        return self._http.build_request("GET", "/files", **self._files_args(sid, rooted(path), user),
                                        timeout=_STREAM_TIMEOUT)

    def _files(self, method: str, sid: str, path: str, parse: Callable[[httpx.Response], Any] = _none,
               content: bytes | Iterable[bytes] | None = None, user: str | None = None) -> Any:
        args = self._files_args(sid, path, user)
        if content is not None:
            args["headers"]["content-type"] = "application/octet-stream"
        return self._do(_Call(method, "/files", content=content, parse=parse, errors=http_error_of, **args))

    def _files_args(self, sid: str, path: str, user: str | None) -> dict[str, Any]:
        """envd's /files query and headers; `user` its `username` query (as envd reads it: never a header)."""
        return {"params": {"path": path, **({} if user is None else {"username": user})},
                "headers": {SANDBOX_HEADER: sid, **({API_KEY_HEADER: self.api_key} if self.api_key else {})}}

    def _follow(self, sid: str, method: str, msg: dict[str, Any], timeout: float | None) -> CommandResult:
        """Start or Connect to the end of the process; past `timeout` (s) it is killed (CommandTimeoutError)."""
        def parse(r: httpx.Response) -> CommandResult:
            stream = ProcessStream(keep=True)
            stream.feed(r.content)
            return stream.result(f"sandbox service at {self.api_url}: {method} in sandbox {sid}")

        limit = {KILL_HEADER: "1"}  # the service's cap applies when no timeout is asked
        if timeout is not None:
            limit["connect-timeout-ms"] = str(max(1, round(timeout * 1000)))
        return self._envd(sid, method, msg, parse, stream=True, headers=limit, timeout=_command_timeout(timeout))

    # --- life cycle -----------------------------------------------------------------------------

    def pause(self, sid: str, hibernate: bool = False) -> None:
        return self._do(_Call("POST", f"/sandboxes/{sid}/pause" if hibernate else f"/sandboxes/{sid}/freeze"))

    def resume(self, sid: str) -> None:
        return self._do(_Call("POST", f"/sandboxes/{sid}/resume"))

    def checkpoint(self, sid: str) -> CheckpointInfo:
        return self._do(_Call("POST", f"/sandboxes/{sid}/snapshots", parse=lambda r: checkpoint_info(r.json())))

    def hibernate(self, sid: str) -> CheckpointInfo:
        return self._do(_Call("POST", f"/sandboxes/{sid}/hibernate", parse=lambda r: checkpoint_info(r.json())))

    def prefetch(self, sid: str, ttl_s: float = 60.0) -> bool:
        return self._do(_Call("POST", f"/sandboxes/{sid}/prefetch", json={"ttlS": ttl_s},
                              parse=lambda r: r.json()["staged"]))

    def fork(self, sid: str, n: int = 1) -> list[SandboxInfo]:
        def parse(r: httpx.Response) -> list[SandboxInfo]:
            return [sandbox_info(s["sandbox"]) for s in r.json()]

        check_number("n", n, 1, MAX_FORK, "children", integer=True)  # named as the SDK names it, not `count`
        return self._do(_Call("POST", f"/sandboxes/{sid}/fork", json={"count": n}, parse=parse))

    def restore(self, ck: str, id: str | None = None, timeout_s: float | None = None) -> SandboxInfo:
        return self._do(_Call("POST", f"/snapshots/{quote(ck, safe='')}/restore",
                              json={"sandboxID": id, "timeout": timeout_s}, parse=lambda r: sandbox_info(r.json())))

    def checkpoints(self) -> list[CheckpointInfo]:
        return self._do(_Call("GET", "/snapshots", parse=lambda r: [checkpoint_info(d) for d in r.json()], paged=True))

    def get_checkpoint(self, ck: str) -> CheckpointInfo:
        return self._do(_Call("GET", f"/snapshots/{quote(ck, safe='')}", parse=lambda r: checkpoint_info(r.json())))

    def delete_checkpoint(self, ck: str) -> None:
        return self._do(_Call("DELETE", f"/templates/{quote(ck, safe='')}"))

    # --- the service ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._do(_Call("GET", "/health", parse=lambda r: r.json()))

    def metrics(self) -> str:
        return self._do(_Call("GET", "/metrics", parse=lambda r: r.text))


class HTTPBackend(_Routes):
    """A `Backend` (see `k3sys.sandbox.sdk.api`) served by a sandbox service at `api_url` (see
    `_Routes` for the arguments). Thread-safe; `close()` when done."""

    def _client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(**kw)

    def _do(self, call: _Call) -> Any:
        with self._reaching():
            r = self._http.send(self._request(call))
        answer = self._answer(call, r)
        return answer if (more := self._next_page(call, r)) is None else answer + self._do(more)

    def read_stream(self, sid: str, path: str, user: str | None = None) -> Iterator[bytes]:
        """The file's contents as they arrive; an error answer raises here, before the first chunk."""
        with self._reaching():
            r = self._http.send(self._read_stream(sid, path, user), stream=True)
        if r.status_code >= 400:
            raise http_error_of(r.status_code, r.read(), r.headers)  # read() closes it

        def chunks() -> Iterator[bytes]:
            with contextlib.closing(r), self._reaching():  # closed also when the reader stops early
                yield from r.iter_bytes()
        return chunks()

    def stream_command(self, cid: str) -> Iterator[tuple[str, str]]:
        """`("stdout" | "stderr", text)` as the command writes it, until it ends (envd's Connect stream)."""
        (method, url, kw), stream, pieces = self._connect_stream(cid), ProcessStream(), OutputPieces()
        with self._reaching(), self._http.stream(method, url, **kw) as r:
            if r.status_code >= 400:
                raise http_error_of(r.status_code, r.read(), r.headers)
            for chunk in r.iter_bytes():
                yield from texts(pieces, stream.feed(chunk), stream.done)
                if stream.done:
                    return
        raise UnavailableError(f"sandbox service at {self.api_url}: the output stream of {cid} broke off")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HTTPBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHTTPBackend(_Routes, AsyncBackend):
    """`HTTPBackend`'s calls as coroutines, over one `httpx.AsyncClient` (use it from one event loop):
    `await backend.create(spec)`, `async for stream, text in backend.stream_command(cid)`."""

    def _client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(**kw)

    async def _do(self, call: _Call) -> Any:
        if call.content is not None and not isinstance(call.content, bytes):
            call = dataclasses.replace(call, content=_aiter(call.content))  # AsyncClient streams async iterables
        with self._reaching():
            r = await self._http.send(self._request(call))
        answer = self._answer(call, r)
        return answer if (more := self._next_page(call, r)) is None else answer + await self._do(more)

    async def read_stream(self, sid: str, path: str, user: str | None = None) -> AsyncIterator[bytes]:
        """See `HTTPBackend.read_stream`: awaiting it opens the file; the chunks are async."""
        with self._reaching():
            r = await self._http.send(self._read_stream(sid, path, user), stream=True)
        if r.status_code >= 400:
            raise http_error_of(r.status_code, await r.aread(), r.headers)  # aread() closes it

        async def chunks() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(r):  # closed also when the reader stops early
                with self._reaching():
                    async for chunk in r.aiter_bytes():
                        yield chunk
        return chunks()

    async def stream_command(self, cid: str) -> AsyncIterator[tuple[str, str]]:
        """See `HTTPBackend.stream_command`."""
        (method, url, kw), stream, pieces = self._connect_stream(cid), ProcessStream(), OutputPieces()
        with self._reaching():
            async with self._http.stream(method, url, **kw) as r:
                if r.status_code >= 400:
                    raise http_error_of(r.status_code, await r.aread(), r.headers)
                async for chunk in r.aiter_bytes():
                    for piece in texts(pieces, stream.feed(chunk), stream.done):  # no `yield from` here
                        yield piece
                    if stream.done:
                        return
        raise UnavailableError(f"sandbox service at {self.api_url}: the output stream of {cid} broke off")

    @property
    def sync(self) -> HTTPBackend:
        """The blocking client of the same service (for a `Sandbox` made from an async handle)."""
        return connect(self.api_url, self.api_key)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncHTTPBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _aiter(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


_clients: dict[tuple[str, str | None], HTTPBackend] = {}
_clients_lock = threading.Lock()


def connect(api_url: str, api_key: str | None = None) -> HTTPBackend:
    """The process-wide `HTTPBackend` for (`api_url`, key), made on first use (connections are reused)."""
    key = api_key if api_key is not None else os.environ.get("K3SYS_API_KEY")
    with _clients_lock:
        client = _clients.get((api_url, key))
        if client is None:
            client = _clients[(api_url, key)] = HTTPBackend(api_url, key)
        return client


_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str | None], AsyncHTTPBackend]]
_async_clients = weakref.WeakKeyDictionary()


def aconnect(api_url: str, api_key: str | None = None) -> AsyncHTTPBackend:
    """The `AsyncHTTPBackend` for (`api_url`, key) on the running event loop, made on first use (an
    AsyncClient must stay on the loop that made it)."""
    key = api_key if api_key is not None else os.environ.get("K3SYS_API_KEY")
    clients = _async_clients.setdefault(asyncio.get_running_loop(), {})
    if (api_url, key) not in clients:
        clients[(api_url, key)] = AsyncHTTPBackend(api_url, key)
    return clients[(api_url, key)]
