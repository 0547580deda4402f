"""`AsyncSandbox`: the SDK's surface for asyncio programs (a trainer driving many sandboxes at once).

    async with await AsyncSandbox.create(api_url="http://127.0.0.1:8765") as sbx:
        r = await sbx.commands.run("echo hi")
        h = await sbx.commands.run("make", background=True)
        async for stream, text in h.stream(): ...
        kids = await sbx.fork(4)
        ck = await sbx.checkpoint()                 # an AsyncCheckpoint: `await ck.delete()`

Every method is `Sandbox`'s (api.py writes the facade once), returning an awaitable. Against a
service (`api_url=` or `K3SYS_API_URL`) each call is a request on one pooled `httpx.AsyncClient`
per event loop, no threads; embedded, each runtime call runs in a worker thread (connection.py).
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass

from k3sys.sandbox.sdk import steps
from k3sys.sandbox.sdk.api import _CheckpointBase, _Facade
from k3sys.sandbox.sdk.commands import AsyncCommandHandle, AsyncCommands
from k3sys.sandbox.sdk.connection import ConnectionConfig
from k3sys.sandbox.sdk.files import AsyncFiles
from k3sys.sandbox.types import SandboxInfo


class _Awaiting:
    """How the asyncio facades reach their backend: every backend call returns an awaitable."""

    _then = staticmethod(steps.later)
    _chain = staticmethod(steps.later_chain)
    _gather = staticmethod(steps.gather_later)
    _found = staticmethod(steps.found_later)
    _connect = staticmethod(lambda conn: ConnectionConfig(**conn).async_backend())


@dataclass(frozen=True)
class AsyncCheckpoint(_Awaiting, _CheckpointBase):
    """`Checkpoint` for asyncio: `await AsyncCheckpoint.get(id)`, `await AsyncCheckpoint.list()`,
    `await ck.delete()`. `AsyncSandbox.restore` and `Sandbox.restore` take either kind."""


class AsyncSandbox(_Awaiting, _Facade):
    """`Sandbox` for asyncio: construct with `await AsyncSandbox.create(...)` (or restore, get, list, fork)."""

    _checkpoint = AsyncCheckpoint
    _handle = AsyncCommandHandle
    _commands = AsyncCommands
    _files = AsyncFiles
    commands: AsyncCommands
    files: AsyncFiles

    def info(self) -> Awaitable[SandboxInfo]:
        """k3sys's earlier name of `get_info()`."""
        return self._rt.info(self.id)

    async def state(self) -> str:
        return (await self.get_info()).state

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()
