"""The sandbox service's limits: admission of new sandboxes (count, memory) and the request body size.

Admission counts every sandbox that holds memory (all but hibernated and lost ones) at its
`memory_mb` limit, which the cgroup enforces, plus reservations of operations still in flight, so
two concurrent creates cannot both take the last slot (nor two of one tenant the last of its quota).
While an operation is in flight its new sandbox may be counted twice (registered and reserved): the
service errs towards refusing.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from k3sys.sandbox._wire import ERROR_HEADER, error_body, status_of
from k3sys.sandbox.errors import CapacityError, TooLargeError
from k3sys.sandbox.runtime.runtime import Runtime
from k3sys.sandbox.service import scope as access
from k3sys.sandbox.service.tenants import Usage
from k3sys.sandbox.spec import SandboxSpec
from k3sys.sandbox.types import CheckpointInfo

_IDLE = ("hibernated", "lost")  # states that hold no memory

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class Admission:
    """Refuses (CapacityError) a new sandbox that would pass `max_sandboxes` or `max_memory_mb` (MiB),
    and (QuotaError) one past its caller's tenant quota (`Scope.check_quota`)."""

    def __init__(self, runtime: Runtime, max_sandboxes: int, max_memory_mb: int) -> None:
        self.runtime = runtime
        self.max_sandboxes = max_sandboxes
        self.max_memory_mb = max_memory_mb
        self._mu = threading.Lock()
        self._pending = [0, 0]  # sandboxes, MiB reserved by operations in flight
        self._pending_by_tenant: dict[str | None, Usage] = {}

    def usage(self) -> tuple[int, int]:
        """(sandboxes, MiB) held now, reservations included."""
        held = [i for i in self.runtime.list() if i.state not in _IDLE]
        return len(held) + self._pending[0], sum(i.spec.memory_mb for i in held) + self._pending[1]

    @contextlib.contextmanager
    def admit(self, n: int, spec: SandboxSpec, scope: access.Scope | None = None, disk: bool = True) -> Iterator[None]:
        """Reserve room for `n` sandboxes of `spec` (for `scope`'s caller) for the length of the block
        (`disk` False: they add no disk, as a resume)."""
        memory_mb, who, adds = spec.memory_mb, scope.who.name if scope is not None else None, Usage.of(n, spec, disk)
        with self._mu:
            count, mb = self.usage()
            if count + n > self.max_sandboxes:
                raise CapacityError(f"the service holds {count} of at most {self.max_sandboxes} sandboxes; "
                                    f"{n} more do not fit (kill or hibernate some)")
            if mb + n * memory_mb > self.max_memory_mb:
                raise CapacityError(f"the service has {mb} of {self.max_memory_mb} MiB of sandbox memory in use; "
                                    f"{n} x {memory_mb} MiB more do not fit (kill or hibernate some)")
            if scope is not None:
                scope.check_quota(n, spec, self._pending_by_tenant.get(who, Usage()), disk)
            self._pending[0] += n
            self._pending[1] += n * memory_mb
            self._pending_by_tenant[who] = self._pending_by_tenant.get(who, Usage()) + adds
        try:
            yield
        finally:
            with self._mu:
                self._pending[0] -= n
                self._pending[1] -= n * memory_mb
                left = self._pending_by_tenant.pop(who) - adds
                if left != Usage():
                    self._pending_by_tenant[who] = left

    def keep(self, ck: CheckpointInfo, scope: access.Scope) -> None:
        """QuotaError unless the caller's tenant is within its disk quota with the checkpoint `ck` it
        just took, counting operations in flight (checked after the checkpoint: its size is known
        only then; a caller that gets the error deletes it)."""
        with self._mu:
            scope.check_kept(ck, self._pending_by_tenant.get(scope.who.name, Usage()))


async def send_error(send: Callable[[Message], Awaitable[None]], exc: BaseException) -> None:
    """Answer with the service's error body, outside any framework (for ASGI middleware)."""
    err = error_body(exc)
    body = json.dumps(err).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (ERROR_HEADER.encode(), err["type"].encode())]
    await send({"type": "http.response.start", "status": status_of(exc), "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, by its Content-Length up front or,
    for a chunked body, as soon as the bytes received pass the limit (the app then sees a disconnect)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self, n: int | str) -> TooLargeError:
        return TooLargeError(f"request body: {n} bytes is over this service's limit of {self.limit} bytes")

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await send_error(send, self._too_large(int(length)))
        seen = 0
        refused = False

        async def limited_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    refused = True
                    await send_error(send, self._too_large(f"more than {self.limit}"))
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: Message) -> None:
            if not refused:  # we answered already
                await send(msg)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not refused:
                raise  # else: the app only noticed the disconnect we made up; the 413 is out
