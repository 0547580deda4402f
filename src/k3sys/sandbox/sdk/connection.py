"""Where an SDK call goes: one `ConnectionConfig` instead of the same three keyword arguments on
every constructor (E2B's shape). The facades take them as `**conn` (`ConnectionOpts`):

    Sandbox.create(runtime=rt)                          # a Backend object: a Runtime, an HTTPBackend, ...
    Sandbox.create(api_url="http://127.0.0.1:8765", api_key=KEY)   # a sandbox service
    Sandbox.create()                                    # K3SYS_API_URL (+ K3SYS_API_KEY) if set, else the
                                                        # process-wide embedded runtime (`default_runtime`)

`ConnectionConfig.backend()` resolves them for the blocking facades, `async_backend()` for the asyncio
ones: there every backend method returns an awaitable (an `AsyncHTTPBackend`, one per event loop, or
the embedded runtime's calls run in worker threads).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypedDict

from k3sys.sandbox.sdk.backend import AsyncBackend, Backend


class ConnectionOpts(TypedDict, total=False):
    """The keyword arguments every facade constructor takes (see `ConnectionConfig`)."""

    runtime: Any
    api_url: str | None
    api_key: str | None


_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="k3sys-aio")  # embedded calls block


class Threaded(AsyncBackend):
    """An embedded backend's methods as coroutines, each call in a worker thread (the runtime is
    thread-safe)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    @property
    def sync(self) -> Backend:
        return self._backend

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._backend, name)

        async def call(*args: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(_POOL, partial(fn, *args))

        return call

    async def read_stream(self, sid: str, path: str, user: str | None = None) -> AsyncIterator[bytes]:
        """Awaiting it opens the file (in a worker thread); each chunk is read in one too."""
        loop = asyncio.get_running_loop()
        kw = {} if user is None else {"user": user}
        chunks = await loop.run_in_executor(_POOL, partial(self._backend.read_stream, sid, path, **kw))

        async def each() -> AsyncIterator[bytes]:
            try:
                while (chunk := await loop.run_in_executor(_POOL, next, chunks, None)) is not None:
                    yield chunk
            finally:
                chunks.close()  # type: ignore[attr-defined]
        return each()

    async def stream_command(self, cid: str) -> AsyncIterator[tuple[str, str]]:
        pieces = self._backend.stream_command(cid)
        loop = asyncio.get_running_loop()
        while (piece := await loop.run_in_executor(_POOL, next, pieces, None)) is not None:
            yield piece


@dataclass(frozen=True)
class ConnectionConfig:
    """A backend object (`runtime`: a `Backend`, or an `AsyncBackend`), or a sandbox service
    (`api_url`, `api_key`; the key defaults to `K3SYS_API_KEY`), or neither: `default_runtime()`."""

    runtime: Any = None
    api_url: str | None = None
    api_key: str | None = None

    def backend(self) -> Backend:
        """The blocking backend these settings name."""
        if isinstance(self.runtime, AsyncBackend):
            return self.runtime.sync
        if self.runtime is not None:
            return self.runtime
        if self.api_url is not None:
            from k3sys.sandbox.sdk.client import connect  # httpx only for remote use

            return connect(self.api_url, self.api_key)
        return default_runtime()

    def async_backend(self) -> AsyncBackend:
        """The awaitable backend these settings name (an HTTP client is per event loop: an
        `httpx.AsyncClient` must stay on the loop that made it)."""
        from k3sys.sandbox.sdk.client import AsyncHTTPBackend, HTTPBackend, aconnect

        rt = self.runtime
        if isinstance(rt, HTTPBackend | AsyncHTTPBackend):
            return aconnect(rt.api_url, rt.api_key)
        if isinstance(rt, AsyncBackend):
            return rt
        if rt is not None:
            return Threaded(rt)
        url = self.api_url or os.environ.get("K3SYS_API_URL")
        return aconnect(url, self.api_key) if url else Threaded(default_runtime())


_default: Backend | None = None
_default_lock = threading.Lock()


def default_runtime() -> Backend:
    """The process-wide backend: a client of the service at `K3SYS_API_URL` when that is set, else
    the embedded runtime, opened on first use."""
    global _default
    if os.environ.get("K3SYS_API_URL"):
        return ConnectionConfig(api_url=os.environ["K3SYS_API_URL"]).backend()
    with _default_lock:
        if _default is None:
            from k3sys.sandbox.runtime.runtime import Runtime  # the runtime (and its store) only when embedded

            _default = Runtime()
        return _default
