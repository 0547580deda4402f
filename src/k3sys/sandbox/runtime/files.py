"""A sandbox's files, read and written from the host through `SandboxFS` (never leaving the
sandbox's root); allowed while the sandbox runs, under its lock."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import BinaryIO

from k3sys.sandbox.runtime.sandboxfs import SandboxFS
from k3sys.sandbox.runtime.state import State
from k3sys.sandbox.runtime.table import Table
from k3sys.sandbox.types import EntryInfo


class Files(Table):
    """`Runtime`'s file operations (see the module docstring)."""

    @contextlib.contextmanager
    def _fs(self, sid: str, op: str) -> Iterator[SandboxFS]:
        with self._locked(sid) as rec:
            self._require(rec, op, State.RUNNING)
            yield SandboxFS(self._dirs(sid).rootfs)

    def read_file(self, sid: str, path: str) -> bytes:
        with self._fs(sid, "read files of") as fs:
            return fs.read(path)

    def open_file(self, sid: str, path: str) -> BinaryIO:
        """The file at `path` open for reading, for streaming it out; the caller closes it. The open
        file stays readable whatever happens to the sandbox afterwards."""
        with self._fs(sid, "read files of") as fs:
            return fs.open(path)

    def write_file(self, sid: str, path: str, data: bytes | str | BinaryIO) -> int:
        with self._fs(sid, "write files of") as fs:
            return fs.write(path, data)

    def list_dir(self, sid: str, path: str = "/") -> list[EntryInfo]:
        with self._fs(sid, "list files of") as fs:
            return fs.list(path)

    def remove(self, sid: str, path: str) -> None:
        with self._fs(sid, "remove files of") as fs:
            fs.remove(path)

    def make_dir(self, sid: str, path: str) -> None:
        with self._fs(sid, "create directories in") as fs:
            fs.makedirs(path)

    def exists(self, sid: str, path: str) -> bool:
        with self._fs(sid, "look up files of") as fs:
            return fs.exists(path)
