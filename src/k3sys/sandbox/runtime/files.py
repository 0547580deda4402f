"""A sandbox's files, through its agent (agent.py): every operation runs inside the sandbox as it
would for its own user, so links, device nodes and FIFOs mean what they mean there, and the host
never opens a path of the sandbox. The state is checked under the sandbox's lock; the operation runs
without it, so a FIFO that blocks a read or write (up to its timeout) never blocks `kill`."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import BinaryIO

from k3sys.sandbox.errors import (
    AgentInterruptedError,
    InvalidArgumentError,
    PathEscapeError,
    SandboxFileNotFoundError,
    TooLargeError,
    WrongFileTypeError,
)
from k3sys.sandbox.runtime.agent import Agent
from k3sys.sandbox.runtime.agent_protocol import xattr_fields, xattrs_of
from k3sys.sandbox.runtime.agents import Agents
from k3sys.sandbox.runtime.state import State
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.watch import MAX_EVENTS, WatchBudget, WatchHandle
from k3sys.sandbox.types import EntryInfo

_KINDS = {"file", "dir", "symlink"}
_CHUNK = 1 << 20
# Bytes read from a regular file whose size says 0 (procfs makes its files up as they are read, so
# only reading to the end tells their length): at most this much, held in memory.
SIZELESS_MAX = 4 << 20


def sandbox_path(path: object) -> str:
    """`path` checked: a non-empty string without NUL that never climbs above the root lexically
    (`/../etc`: PathEscapeError, as before; a link that climbs resolves inside, like the kernel does
    at `/`). Relative paths start at the sandbox's root."""
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"path: expected a non-empty string, got {path!r}")
    if "\0" in path:
        raise InvalidArgumentError(f"path: NUL byte in {path!r}")
    depth = 0
    for part in path.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise PathEscapeError(f"path: {path!r} climbs above the sandbox root")
        elif part not in ("", "."):
            depth += 1
    return path if path.startswith("/") else "/" + path


def _entry(f: dict[str, str]) -> EntryInfo:
    kind = f["type"] if f["type"] in _KINDS else "other"
    return EntryInfo(f["name"], f["path"], kind, int(f["size"]), int(f["mode"], 8), int(f["mtime_ns"]) / 1e9,
                     int(f.get("uid", 0)), int(f.get("gid", 0)), f.get("target"), xattrs_of(f))


class _Reader(io.RawIOBase):
    """A sandbox file streamed from its agent, `size` bytes (its size when opened); a checkpoint
    cutting the stream only pauses it (it reconnects at the offset it reached)."""

    def __init__(self, agents: Agents, sid: str, path: str, size: int, user: str | None) -> None:
        super().__init__()
        self._agents, self._sid, self._path, self.size, self._user = agents, sid, path, size, user
        self._pos = 0
        self._buf = b""
        self._chunks: Iterator[bytes] | None = None

    def readable(self) -> bool:
        return True

    def fill(self) -> None:
        """Fetch the next chunk unless one is waiting (none past the end). The first call opens the
        file inside the sandbox, so it raises what opening raises (PermissionDeniedError)."""
        while not self._buf and self._pos < self.size:
            if self._chunks is None:
                self._chunks = self._agents.get(self._sid).read_chunks(
                    self._path, user=self._user, offset=self._pos, max_bytes=self.size - self._pos)
            try:
                self._buf = next(self._chunks, b"")
            except AgentInterruptedError:
                self._chunks = None
                continue
            if not self._buf:
                self.size = self._pos  # the file shrank meanwhile

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        self.fill()
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        self._pos += n
        return n

    def close(self) -> None:
        if self._chunks is not None:
            self._chunks.close()  # type: ignore[attr-defined]
        super().close()


class _Sized(io.BytesIO):
    """Bytes read already, with the `size` a `_Reader` has."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.size = len(data)


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    with f:
        while chunk := f.read(_CHUNK):
            yield chunk


class FileService:
    """The files of the sandboxes in `table` (see the module docstring)."""

    def __init__(self, table: SandboxTable, agents: Agents) -> None:
        self.table = table
        self.agents = agents
        self.watches = WatchBudget()  # watches open per sandbox (watch.py)

    def _files(self, sid: str, op: str) -> Agent:
        with self.table.locked(sid) as rec:
            self.table.require(rec, op, State.RUNNING)
            return self.agents.get(sid)

    def read_file(self, sid: str, path: str, user: str | None = None) -> bytes:
        with self.open_file(sid, path, user) as f:
            return f.read()

    def read_stream(self, sid: str, path: str, user: str | None = None) -> Iterator[bytes]:
        """The file's contents in chunks of at most 1 MiB, never held whole; opened (and refused, as
        `open_file` refuses) before the first chunk is asked for."""
        return _chunks(self.open_file(sid, path, user))

    def open_file(self, sid: str, path: str, user: str | None = None) -> BinaryIO:
        """The regular file at `path` for streaming out (`.size`: its size now, what the stream
        delivers), opened already (PermissionDeniedError if `user` may not read it); the caller
        closes it. Anything else is refused: a device or FIFO could stream
        without end into host memory (a device is opened first, so one the sandbox may not use
        answers with its EPERM)."""
        path = sandbox_path(path)
        self._files(sid, "read files of")
        st = self.agents.retrying(sid, lambda a: a.stat(path, follow=True, user=user))
        if st["type"] == "dir":
            raise WrongFileTypeError(f"is a directory in the sandbox: {path!r}")
        if st["type"] in ("char", "block"):
            # PermissionDeniedError if refused
            self.agents.retrying(sid, lambda a: a.read(path, user=user, max_bytes=0))
        if st["type"] != "file":
            raise WrongFileTypeError(f"not a regular file in the sandbox ({st['type']}): {path!r}")
        if st["size"] == "0":  # empty, or a procfs file: read to its end, bounded
            data = self.agents.retrying(sid, lambda a: a.read(path, user=user, max_bytes=SIZELESS_MAX + 1))
            if len(data) > SIZELESS_MAX:
                raise TooLargeError(f"{path!r}: its size says 0 but it reads past {SIZELESS_MAX} bytes")
            return _Sized(data)  # type: ignore[return-value]
        reader = _Reader(self.agents, sid, path, int(st["size"]), user)
        try:
            # Opened inside before it is returned: a file the user may not read is refused here, before
            # a caller (envd's GET /files) has promised any byte of it.
            reader.fill()
        except BaseException:
            reader.close()
            raise
        return reader  # type: ignore[return-value]

    def write_file(self, sid: str, path: str, data: bytes | str | BinaryIO, user: str | None = None,
                   xattrs: dict[str, bytes] | None = None) -> int:
        """Create or replace the file at `path` (missing directories are created) as `user` (None:
        the agent's default, root); returns the bytes written. `data` may be a binary file object,
        sent in chunks. `xattrs` (user.* names; agent_protocol has the bounds) are set on the new
        file before it replaces the old one, whose attributes go with it."""
        xattr_fields(xattrs)  # bad names or sizes refused before anything is sent
        path = sandbox_path(path)
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes | bytearray | memoryview) and not hasattr(data, "read"):
            raise InvalidArgumentError(f"data: expected bytes, str or a binary file, got {type(data).__name__}")
        self._files(sid, "write files of")
        if not hasattr(data, "read"):
            # Replacing a file is idempotent: a write cut by a checkpoint is simply made again.
            return self.agents.retrying(sid, lambda a: a.write(path, data, parents=True, user=user,  # type: ignore[arg-type]
                                                         xattrs=xattrs))
        start = data.tell() if data.seekable() else None  # type: ignore[union-attr]

        def send(a: Agent) -> int:
            if start is not None:
                data.seek(start)  # type: ignore[union-attr]
            return a.write(path, iter(lambda: data.read(_CHUNK), b""), parents=True,  # type: ignore[union-attr]
                           user=user, xattrs=xattrs)
        # A stream that cannot be rewound is sent once; a checkpoint cutting it raises the retryable
        # AgentInterruptedError to the caller.
        return self.agents.retrying(sid, send) if start is not None else send(self.agents.get(sid))

    def list_dir(self, sid: str, path: str = "/", depth: int = 1, user: str | None = None) -> list[EntryInfo]:
        """Entries of directory `path` and, to `depth` levels, of the directories below it, sorted by
        path (symlinks are listed, not followed)."""
        path = sandbox_path(path)
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 1 << 16:
            raise InvalidArgumentError(f"depth: expected an integer from 1, got {depth!r}")
        self._files(sid, "list files of")
        try:
            entries = self.agents.retrying(sid, lambda a: a.list(path, depth=depth, user=user, xattrs=True))
        except WrongFileTypeError:
            raise WrongFileTypeError(f"not a directory in the sandbox: {path!r}") from None
        return sorted((_entry(f) for f in entries), key=lambda e: e.path)

    def stat(self, sid: str, path: str, user: str | None = None) -> EntryInfo:
        """The entry at `path` (a symlink itself, not its target); SandboxFileNotFoundError if none."""
        path = sandbox_path(path)
        self._files(sid, "look up files of")
        f = self.agents.retrying(sid, lambda a: a.stat(path, user=user, xattrs=True))
        return _entry({"name": path.rstrip("/").rpartition("/")[2] or "/", "path": path, **f})

    def move(self, sid: str, src: str, dst: str, user: str | None = None) -> None:
        """Rename `src` to `dst` inside the sandbox (InvalidArgumentError across file systems)."""
        src, dst = sandbox_path(src), sandbox_path(dst)
        self._files(sid, "move files of")
        self.agents.retrying(sid, lambda a: a.move(src, dst, user=user))

    def remove(self, sid: str, path: str, user: str | None = None) -> None:
        path = sandbox_path(path)
        if path.strip("/") == "":
            raise InvalidArgumentError("path: refusing to remove the sandbox's root")
        self._files(sid, "remove files of")
        self.agents.retrying(sid, lambda a: a.remove(path, user=user))

    def make_dir(self, sid: str, path: str, user: str | None = None) -> None:
        """Create directory `path` and any missing parents (`mkdir -p`)."""
        path = sandbox_path(path)
        self._files(sid, "create directories in")
        self.agents.retrying(sid, lambda a: a.mkdir(path, user=user))

    def exists(self, sid: str, path: str, user: str | None = None) -> bool:
        """Whether `path` names an entry in the sandbox (a dangling link counts)."""
        path = sandbox_path(path)
        self._files(sid, "look up files of")
        try:
            self.agents.retrying(sid, lambda a: a.stat(path, user=user))
        except SandboxFileNotFoundError:
            return False
        return True

    def watch_dir(self, sid: str, path: str, recursive: bool = False, max_events: int = MAX_EVENTS) -> WatchHandle:
        """Watch directory `path` (and, with `recursive`, every directory below it) for changes;
        returns once the watch is in place. `get_new_events()` on the handle drains what happened
        since, `stop()` ends it; at most `max_events` wait unread, later ones are counted in
        `dropped` (watch.py). SandboxLimitError when the sandbox has `watch.MAX_WATCHES` open, or
        its root's inotify instances or watches inside it ran out (the message names which)."""
        path = sandbox_path(path)
        agent = self._files(sid, "watch files of")
        self.watches.take(sid)
        try:
            return WatchHandle(agent, path, recursive, max_events, on_end=lambda: self.watches.give(sid))
        except RuntimeError:  # no thread could start: the watch never began
            self.watches.give(sid)
            raise
