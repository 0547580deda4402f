"""Host-side access to a sandbox's files that can never leave the sandbox's root.

A sandbox path is resolved the way the sandbox itself would see it: component by component with
`openat(O_NOFOLLOW)` from a descriptor of the root, symlinks expanded inside the root (an absolute
link target starts again at the sandbox's `/`, not the host's). A path that climbs above the root,
lexically (`/../etc`) or through a link (`link -> ../../..`), raises `PathEscapeError`; nothing on
the host outside the root is ever opened. Because every step is relative to a descriptor we already
hold, a process in the sandbox swapping a directory for a symlink mid-walk cannot redirect us.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from k3sys.sandbox.errors import InvalidArgumentError, PathEscapeError, SandboxFileNotFoundError, WrongFileTypeError
from k3sys.sandbox.types import EntryInfo

_MAX_LINKS = 40  # as the kernel's own limit on symlinks followed in one lookup
_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}


def _parts(path: str) -> list[str]:
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"path: expected a non-empty string, got {path!r}")
    if "\0" in path:
        raise InvalidArgumentError(f"path: NUL byte in {path!r}")
    return [p for p in path.split("/") if p not in ("", ".")]


class SandboxFS:
    """Files of one sandbox, seen through its merged root directory on the host."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @contextmanager
    def _walk(self, path: str, *, follow_last: bool = True, parent: bool = False) -> Iterator[tuple[int, str]]:
        """Yield `(dir_fd, name)` for `path`: a descriptor of its directory and its last component.

        With `parent`, missing final components are fine (for creating them); `name` is "" for the root.
        """
        todo = _parts(path)
        stack = [os.open(self.root, os.O_PATH | os.O_DIRECTORY)]  # descriptors from the root down
        links = 0
        try:
            while todo:
                name = todo.pop(0)
                if name == "..":
                    if len(stack) == 1:
                        raise PathEscapeError(f"path: {path!r} climbs above the sandbox root")
                    os.close(stack.pop())
                    continue
                last = not todo
                try:
                    st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
                except FileNotFoundError:
                    if last and parent:
                        yield stack[-1], name
                        return
                    raise SandboxFileNotFoundError(f"no such file or directory in the sandbox: {path!r}") from None
                if stat.S_ISLNK(st.st_mode) and (follow_last or not last):
                    links += 1
                    if links > _MAX_LINKS:
                        raise InvalidArgumentError(f"path: too many levels of symlinks in {path!r}")
                    target = os.readlink(name, dir_fd=stack[-1])
                    if target.startswith("/"):  # absolute: from the sandbox's own root
                        for fd in stack[1:]:
                            os.close(fd)
                        del stack[1:]
                    todo = _parts(target) + todo if target.strip("/") else todo
                    continue
                if last:
                    yield stack[-1], name
                    return
                if not stat.S_ISDIR(st.st_mode):
                    raise SandboxFileNotFoundError(f"not a directory in the sandbox: {name!r} in {path!r}")
                stack.append(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=stack[-1]))
            yield stack[-1], ""
        finally:
            for fd in stack:
                os.close(fd)

    def _open_dir(self, path: str) -> int:
        with self._walk(path) as (dfd, name):
            if not name:
                return os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=dfd)
            try:
                return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            except NotADirectoryError:
                raise WrongFileTypeError(f"not a directory in the sandbox: {path!r}") from None

    def open(self, path: str) -> BinaryIO:
        """The regular file at `path`, open for reading (the caller closes it)."""
        with self._walk(path) as (dfd, name):
            if not name:
                raise WrongFileTypeError(f"is a directory in the sandbox: {path!r}")
            # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # opening a directory read-only succeeds: check what it is
            os.close(fd)
            what = "is a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise WrongFileTypeError(f"{what} in the sandbox: {path!r}")
        # Blocking reads from here: with O_NONBLOCK a read of data not in the page cache may fail
        # with EAGAIN, which a file object reports as no data (an empty or short file).
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    def read(self, path: str) -> bytes:
        """The whole content of the file at `path`."""
        with self.open(path) as f:
            return f.read()

    def write(self, path: str, data: bytes | str | BinaryIO, mode: int = 0o644) -> int:
        """Create or replace the file at `path` (parent directories are created); returns bytes written.

        `data` may be a binary file object, copied in chunks (large uploads never sit in memory whole).
        """
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes | bytearray | memoryview) and not hasattr(data, "read"):
            raise InvalidArgumentError(f"data: expected bytes, str or a binary file, got {type(data).__name__}")
        parts = _parts(path)
        if not parts:
            raise InvalidArgumentError(f"path: {path!r} is the sandbox root, not a file")
        self.makedirs("/".join(parts[:-1]) or "/")
        with self._walk(path, parent=True) as (dfd, name):
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode, dir_fd=dfd)
            except IsADirectoryError:
                raise WrongFileTypeError(f"is a directory in the sandbox: {path!r}") from None
        with os.fdopen(fd, "wb") as f:
            if not hasattr(data, "read"):
                return f.write(data)
            n = 0
            while chunk := data.read(1 << 20):
                n += f.write(chunk)
            return n

    def makedirs(self, path: str) -> None:
        """Create directory `path` and its missing parents (like `mkdir -p`)."""
        done: list[str] = []
        for part in _parts(path):
            done.append(part)
            with self._walk("/".join(done), parent=True) as (dfd, name):
                if name:
                    try:
                        os.mkdir(name, 0o755, dir_fd=dfd)
                    except FileExistsError:
                        if not stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                            raise WrongFileTypeError(f"not a directory in the sandbox: {'/'.join(done)!r}") from None

    def list(self, path: str = "/") -> list[EntryInfo]:
        """Entries of directory `path`, sorted by name (symlinks are listed, not followed)."""
        fd = self._open_dir(path)
        try:
            out = []
            base = "/" + "/".join(_parts(path))
            for name in sorted(os.listdir(fd)):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                kind = _KINDS.get(stat.S_IFMT(st.st_mode), "other")
                out.append(EntryInfo(name, base.rstrip("/") + "/" + name, kind, st.st_size, stat.S_IMODE(st.st_mode),
                                     st.st_mtime))
            return out
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        """Remove the file, link or directory tree at `path` (a link is removed, not its target)."""
        with self._walk(path, follow_last=False) as (dfd, name):
            if not name:
                raise InvalidArgumentError(f"path: refusing to remove the sandbox root ({path!r})")
            _remove_at(dfd, name)

    def exists(self, path: str) -> bool:
        """Whether `path` names an entry in the sandbox (a dangling link counts)."""
        try:
            with self._walk(path, follow_last=False):
                return True
        except SandboxFileNotFoundError:
            return False


def _remove_at(dfd: int, name: str) -> None:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    try:
        for child in os.listdir(fd):
            _remove_at(fd, child)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dfd)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
