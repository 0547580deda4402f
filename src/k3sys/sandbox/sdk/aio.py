"""`AsyncSandbox`: the SDK's surface for asyncio programs (a trainer driving many sandboxes at once).

    async with await AsyncSandbox.create(api_url="http://127.0.0.1:8765") as sbx:
        r = await sbx.commands.run("echo hi")
        h = await sbx.commands.run("make", background=True)
        async for stream, text in h.stream(): ...
        kids = await sbx.fork(4)

Every method is `Sandbox`'s, awaited. Against a service (`api_url=` or `K3SYS_API_URL`) each call is a
request on one pooled `httpx.AsyncClient` per event loop, no threads; embedded, each runtime call runs
in a worker thread (the runtime is thread-safe). Checkpoints are the sync `Checkpoint` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, BinaryIO

from k3sys.sandbox.errors import NotFoundError
from k3sys.sandbox.sdk.api import Backend, Checkpoint, default_runtime
from k3sys.sandbox.sdk.client import AsyncHTTPBackend, HTTPBackend, connect
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import EntryInfo, SandboxInfo

_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="k3sys-aio")  # embedded calls block


class _Threaded:
    """An embedded backend's methods as coroutines, each call in a worker thread."""

    def __init__(self, backend: Backend) -> None:
        self.sync = backend

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.sync, name)

        async def call(*args: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(_POOL, partial(fn, *args))

        return call

    async def stream_command(self, cid: str) -> AsyncIterator[tuple[str, str]]:
        pieces = self.sync.stream_command(cid)
        loop = asyncio.get_running_loop()
        while (piece := await loop.run_in_executor(_POOL, next, pieces, None)) is not None:
            yield piece


class _Remote(AsyncHTTPBackend):
    @property
    def sync(self) -> HTTPBackend:
        """The blocking twin (for `Checkpoint.delete` and friends)."""
        return connect(self.api_url, self.api_key)


AsyncBackend = _Threaded | _Remote
_remotes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str | None], _Remote]] = (
    weakref.WeakKeyDictionary())


def _aconnect(api_url: str, api_key: str | None) -> _Remote:
    """One async client per (url, key) per event loop: an AsyncClient must stay on its loop."""
    key = api_key if api_key is not None else os.environ.get("K3SYS_API_KEY")
    clients = _remotes.setdefault(asyncio.get_running_loop(), {})
    if (api_url, key) not in clients:
        clients[(api_url, key)] = _Remote(api_url, key)
    return clients[(api_url, key)]


def _abackend(runtime: Backend | AsyncBackend | None = None, api_url: str | None = None,
              api_key: str | None = None) -> AsyncBackend:
    if isinstance(runtime, _Threaded | _Remote):
        return runtime
    if isinstance(runtime, HTTPBackend):
        return _aconnect(runtime.api_url, runtime.api_key)
    if runtime is not None:
        return _Threaded(runtime)
    url = api_url or os.environ.get("K3SYS_API_URL")
    if url:
        return _aconnect(url, api_key)
    return _Threaded(default_runtime())


class AsyncCommandHandle:
    """A command started with `background=True` (see `CommandHandle`)."""

    def __init__(self, backend: AsyncBackend, cid: str) -> None:
        self._rt = backend
        self.id = cid

    async def wait(self, timeout: float | None = None) -> CommandResult:
        return await self._rt.wait_command(self.id, timeout)

    async def kill(self) -> None:
        await self._rt.kill_command(self.id)

    async def running(self) -> bool:
        return await self._rt.command_running(self.id)

    async def output(self) -> tuple[str, str]:
        return await self._rt.command_output(self.id)

    def stream(self) -> AsyncIterator[tuple[str, str]]:
        """`("stdout" | "stderr", text)` pieces as the command writes them, until it ends."""
        return self._rt.stream_command(self.id)

    def __repr__(self) -> str:
        return f"AsyncCommandHandle({self.id!r})"


class AsyncCommands:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def run(self, cmd: str, timeout: float | None = 60, cwd: str | None = None,
                  env: dict[str, str] | None = None, background: bool = False,
                  stdin: bytes | str | None = None) -> Any:
        """See `Commands.run`: a CommandResult, or an AsyncCommandHandle with `background=True`."""
        data = stdin.encode() if isinstance(stdin, str) else stdin
        rt, sid = self._sbx._rt, self._sbx.id
        if background:
            return AsyncCommandHandle(rt, await rt.start_command(sid, cmd, cwd, env, data))
        return await rt.run(sid, cmd, timeout, cwd, env, data)


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def read(self, path: str) -> bytes:
        return await self._sbx._rt.read_file(self._sbx.id, path)

    async def read_text(self, path: str) -> str:
        return (await self.read(path)).decode()

    async def write(self, path: str, data: bytes | str | BinaryIO) -> int:
        return await self._sbx._rt.write_file(self._sbx.id, path, data)

    async def list(self, path: str = "/") -> list[EntryInfo]:
        return await self._sbx._rt.list_dir(self._sbx.id, path)

    async def remove(self, path: str) -> None:
        await self._sbx._rt.remove(self._sbx.id, path)

    async def make_dir(self, path: str) -> None:
        await self._sbx._rt.make_dir(self._sbx.id, path)

    async def exists(self, path: str) -> bool:
        return await self._sbx._rt.exists(self._sbx.id, path)


class AsyncSandbox:
    """`Sandbox` for asyncio: construct with `await AsyncSandbox.create(...)` (or restore, get, list, fork)."""

    def __init__(self, backend: AsyncBackend, id: str) -> None:
        self._rt = backend
        self.id = id
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @classmethod
    async def create(cls, template: str = "busybox", cpu: float = 1.0, memory_mb: int = 512, pids: int = 256,
                     network: bool = False, timeout_s: float | None = None, on_timeout: str | None = None, *,
                     id: str | None = None, runtime: Any = None, api_url: str | None = None,
                     api_key: str | None = None) -> AsyncSandbox:
        rt = _abackend(runtime, api_url, api_key)
        spec = SandboxSpec(template, cpu, memory_mb, pids, network, timeout_s, on_timeout)
        return cls(rt, (await rt.create(spec, id)).id)

    @classmethod
    async def restore(cls, checkpoint: Checkpoint | str, *, id: str | None = None, timeout_s: float | None = None,
                      runtime: Any = None, api_url: str | None = None, api_key: str | None = None) -> AsyncSandbox:
        ck = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
        if runtime is None and api_url is None and isinstance(checkpoint, Checkpoint):
            runtime = checkpoint.runtime
        rt = _abackend(runtime, api_url, api_key)
        return cls(rt, (await rt.restore(ck, id, timeout_s)).id)

    @classmethod
    async def get(cls, id: str, runtime: Any = None, *, api_url: str | None = None,
                  api_key: str | None = None) -> AsyncSandbox:
        rt = _abackend(runtime, api_url, api_key)
        return cls(rt, (await rt.info(id)).id)

    @classmethod
    async def list(cls, runtime: Any = None, *, api_url: str | None = None,
                   api_key: str | None = None) -> list[AsyncSandbox]:
        rt = _abackend(runtime, api_url, api_key)
        return [cls(rt, i.id) for i in await rt.list()]

    async def info(self) -> SandboxInfo:
        return await self._rt.info(self.id)

    async def state(self) -> str:
        return (await self.info()).state

    async def memory_bytes(self) -> int:
        return await self._rt.memory_bytes(self.id)

    async def cpu_seconds(self) -> float:
        return await self._rt.cpu_seconds(self.id)

    async def pause(self) -> None:
        await self._rt.pause(self.id)

    async def resume(self) -> None:
        await self._rt.resume(self.id)

    async def checkpoint(self) -> Checkpoint:
        return Checkpoint._of(await self._rt.checkpoint(self.id), self._rt.sync)

    async def hibernate(self) -> Checkpoint:
        return Checkpoint._of(await self._rt.hibernate(self.id), self._rt.sync)

    async def prefetch(self, ttl_s: float = 60.0) -> bool:
        return await self._rt.prefetch(self.id, ttl_s)

    async def fork(self, n: int = 1) -> list[AsyncSandbox]:
        _, kids = await self._rt.fork(self.id, n)
        return [AsyncSandbox(self._rt, k.id) for k in kids]

    async def kill(self) -> None:
        await self._rt.kill(self.id)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(NotFoundError):
            await self.kill()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AsyncSandbox) and other.id == self.id and other._rt is self._rt

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"
