"""`sbx.files`: the sandbox's file system in E2B's call shapes.

    sbx.files.write("/app/state.json", "{}")          # WriteInfo(name, type, path)
    sbx.files.read("/app/state.json")                 # str; format="bytes": bytes, "stream": chunks
    sbx.files.write_files([{"path": "/a", "data": b"1"}, {"path": "/b", "data": "2"}])
    sbx.files.get_info("/a"); sbx.files.rename("/a", "/c"); sbx.files.make_dir("/d")   # -> bool

E2B's `read` gives text by default, so k3sys's earlier `read(path) -> bytes` is now
`read(path, format="bytes")`; `read_text` stays. `write` returns E2B's `WriteInfo` (it returned the
byte count). Paths are the sandbox's own; none can leave its root. `user` (None: the template's
default user) is the embedded runtime's; `request_timeout` is accepted for E2B's signatures (an
embedded call has no request to time). `AsyncFiles` is the asyncio sibling: the same calls as
coroutines, each described once in `Files` (api.py's `_then`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

from k3sys.sandbox.errors import InvalidArgumentError
from k3sys.sandbox.types import EntryInfo

WriteData = bytes | str | BinaryIO
_FORMATS = ("text", "bytes", "stream")


@dataclass(frozen=True)
class WriteInfo:
    """What a write made (E2B's `WriteInfo`): the file's name, its type ("file") and its path."""

    name: str
    type: str | None
    path: str


def _written(path: str) -> WriteInfo:
    return WriteInfo(path.rstrip("/").rpartition("/")[2], "file", path)


def _as(data: bytes, format: str) -> str | bytes:
    if format == "bytes":
        return data
    return data.decode(errors="replace")


def _user(user: str | None) -> dict[str, str]:
    """The `user` keyword for the backend only when one is named (the remote backend takes none)."""
    return {} if user is None else {"user": user}


class Files:
    """`sbx.files` (see the module docstring). Each call is described here once; through an
    `AsyncSandbox` the same description gives awaitables, which `AsyncFiles` awaits."""

    def __init__(self, sandbox: Any) -> None:  # api.py's _Facade (api.py imports this module)
        self._sbx = sandbox

    def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text", user: str | None = None,
             request_timeout: float | None = None) -> str | bytes | Iterator[bytes]:
        """The file's contents: `format` "text" (UTF-8, undecodable bytes replaced), "bytes", or
        "stream" (an iterator of byte chunks)."""
        if format not in _FORMATS:
            raise InvalidArgumentError(f"format: expected one of {_FORMATS}, got {format!r}")
        if format == "stream":  # never whole in memory: the backend's chunks as they come
            return self._sbx._then(self._sbx._rt.read_stream(self._sbx.id, path, **_user(user)), lambda c: c)
        return self._sbx._then(self._sbx._rt.read_file(self._sbx.id, path, **_user(user)), lambda b: _as(b, format))

    def read_text(self, path: str) -> str:
        """k3sys's earlier name of `read(path)`."""
        return self.read(path)

    def write(self, path: str, data: WriteData, user: str | None = None,
              request_timeout: float | None = None) -> WriteInfo:
        """Create or replace a file, its missing parents made; a WriteInfo. `data` may be a binary
        file object: it is streamed, never held in memory whole."""
        return self._sbx._then(self._sbx._rt.write_file(self._sbx.id, path, data, **_user(user)),
                               lambda _: _written(path))

    def write_files(self, files: Sequence[dict[str, Any]], user: str | None = None,
                    request_timeout: float | None = None) -> list[WriteInfo]:
        """`write` for each `{"path": ..., "data": ...}` in order; their WriteInfos."""
        for f in files:
            if not isinstance(f, dict) or set(f) != {"path", "data"}:
                raise InvalidArgumentError(f"files: expected {{'path': ..., 'data': ...}} entries, got {f!r}")
        return self._sbx._gather([self.write(f["path"], f["data"], user) for f in files])

    def list(self, path: str = "/", depth: int | None = 1, user: str | None = None,
             request_timeout: float | None = None) -> list[EntryInfo]:
        """The entries of directory `path` (to `depth` levels below it; embedded only past 1)."""
        kw = {**_user(user), **({} if depth in (1, None) else {"depth": depth})}
        return self._sbx._rt.list_dir(self._sbx.id, path, **kw)

    def exists(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        return self._sbx._rt.exists(self._sbx.id, path, **_user(user))

    def get_info(self, path: str, user: str | None = None, request_timeout: float | None = None) -> EntryInfo:
        """The EntryInfo of `path` (a symlink itself); SandboxFileNotFoundError if none."""
        return self._sbx._rt.stat(self._sbx.id, path, **_user(user))

    def remove(self, path: str, user: str | None = None, request_timeout: float | None = None) -> None:
        """Remove a file, symlink or directory tree."""
        return self._sbx._rt.remove(self._sbx.id, path, **_user(user))

    def rename(self, old_path: str, new_path: str, user: str | None = None,
               request_timeout: float | None = None) -> EntryInfo:
        """Move `old_path` to `new_path`; the EntryInfo at the new path."""
        sbx = self._sbx
        return sbx._chain(sbx._rt.move(sbx.id, old_path, new_path, **_user(user)),
                          lambda _: self.get_info(new_path, user))

    def make_dir(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        """Create directory `path` and its missing parents: True, or False if it was there already."""
        sbx = self._sbx
        return sbx._chain(self.exists(path, user), lambda there: False if there else sbx._then(
            sbx._rt.make_dir(sbx.id, path, **_user(user)), lambda _: True))

    def watch_dir(self, path: str, user: str | None = None, request_timeout: float | None = None,
                  recursive: bool = False) -> Any:
        """Watch a directory (with `recursive`, its whole tree): the handle's `get_new_events()`
        gives the `FilesystemEvent`s since the last call, `stop()` ends it. Over HTTP the service
        keeps the watch (envd's CreateWatcher); `dropped` and `overflows` are embedded only."""
        if isinstance(user, bool):  # k3sys's earlier `watch_dir(path, True)`: recursive
            user, recursive = None, user
        return self._sbx._rt.watch_dir(self._sbx.id, path, recursive)


def _awaited(value: object) -> Awaitable[Any]:
    """A `Files` / `Commands` answer on an asyncio facade: an awaitable, whatever the sync hint says."""
    return value  # type: ignore[return-value]


class AsyncFiles:
    """`AsyncSandbox.files`: `Files`' calls as coroutines (see `Files` for each)."""

    def __init__(self, sandbox: Any) -> None:  # api.py's _Facade (api.py imports this module)
        self._calls = Files(sandbox)

    async def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text", user: str | None = None,
                   request_timeout: float | None = None) -> str | bytes | Iterator[bytes]:
        return await _awaited(self._calls.read(path, format, user, request_timeout))

    async def read_text(self, path: str) -> str:
        return await _awaited(self._calls.read(path))

    async def write(self, path: str, data: WriteData, user: str | None = None,
                    request_timeout: float | None = None) -> WriteInfo:
        return await _awaited(self._calls.write(path, data, user, request_timeout))

    async def write_files(self, files: Sequence[dict[str, Any]], user: str | None = None,
                          request_timeout: float | None = None) -> list[WriteInfo]:
        return await _awaited(self._calls.write_files(files, user, request_timeout))

    async def list(self, path: str = "/", depth: int | None = 1, user: str | None = None,
                   request_timeout: float | None = None) -> list[EntryInfo]:
        return await _awaited(self._calls.list(path, depth, user, request_timeout))

    async def exists(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        return await _awaited(self._calls.exists(path, user, request_timeout))

    async def get_info(self, path: str, user: str | None = None, request_timeout: float | None = None) -> EntryInfo:
        return await _awaited(self._calls.get_info(path, user, request_timeout))

    async def remove(self, path: str, user: str | None = None, request_timeout: float | None = None) -> None:
        return await _awaited(self._calls.remove(path, user, request_timeout))

    async def rename(self, old_path: str, new_path: str, user: str | None = None,
                     request_timeout: float | None = None) -> EntryInfo:
        return await _awaited(self._calls.rename(old_path, new_path, user, request_timeout))

    async def make_dir(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        return await _awaited(self._calls.make_dir(path, user, request_timeout))

    async def watch_dir(self, path: str, user: str | None = None, request_timeout: float | None = None,
                        recursive: bool = False) -> Any:
        return await _awaited(self._calls.watch_dir(path, user, request_timeout, recursive))
