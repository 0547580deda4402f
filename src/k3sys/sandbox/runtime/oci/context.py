"""COPY / ADD sources taken from a build context, never through its links.

A source path is relative to the context (a leading `/` too, as docker reads it) and may not leave
it (`..` past the top is refused). It is reached one component at a time with O_NOFOLLOW: a
directory component that is a symbolic link is refused (BuildError naming it), so a context holding
`data -> /etc` cannot copy the host's /etc. The source itself, and everything below a copied
directory, is copied as it is: links as links (never followed), files and directories with their
modes; devices, sockets and FIFOs are refused. Globs (`*`, `?`, `[...]`) may stand in the last
component. `.dockerignore` at the context's top leaves out what it matches (E2B's port of moby's
matcher).

`plan` walks the sources once and returns what they are with the hash of their content (the step's
cache input); `fill` writes them into a layer.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import posixpath
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from e2b_dockerfile_utils import PatternMatcher

from k3sys.sandbox.errors import BuildError
from k3sys.sandbox.runtime.oci.unpack import IMPLIED

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Source:
    """One file system object to copy: `rel` its path in the context, `dest` below the step's
    destination (relative, `/`-separated), its kind and mode, a link's `target`."""

    rel: str
    dest: str
    kind: str  # "dir", "file", "link"
    mode: int
    target: str = ""


def _open_dir(root: int, parts: list[str], what: str) -> int:
    fd = os.dup(root)
    for i, p in enumerate(parts):
        try:
            nxt = os.open(p, _DIR, dir_fd=fd)
        except FileNotFoundError:
            os.close(fd)
            raise BuildError(f"{what}: {'/'.join(parts[:i + 1])!r} is not in the context") from None
        except OSError:
            os.close(fd)
            raise BuildError(f"{what}: {'/'.join(parts[:i + 1])!r} is a symbolic link or not a directory in "
                             "the context: not followed") from None
        os.close(fd)
        fd = nxt
    return fd


def _matches(context: int) -> PatternMatcher | None:
    try:
        fd = os.open(".dockerignore", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=context)
    except FileNotFoundError:
        return None
    with open(fd) as f:
        lines = [ln.strip() for ln in f.read(1 << 20).splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    return PatternMatcher(patterns) if patterns else None


class Context:
    """The build context directory `root` (None: an empty one)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    @contextlib.contextmanager
    def _fd(self) -> Iterator[int]:
        if self.root is None:
            raise BuildError("COPY / ADD: the build has no context directory")
        fd = os.open(self.root, _DIR)
        try:
            yield fd
        finally:
            os.close(fd)

    def plan(self, srcs: list[str], dest_is_dir: bool, what: str) -> tuple[list[Source], str]:
        """What `srcs` name (a directory source: its contents), each with its place below the
        destination directory (`dest` "" : the destination itself, for one file copied to a file
        path), and the sha256 of their paths, kinds, modes, links and contents."""
        h = hashlib.sha256()
        out: list[Source] = []
        with self._fd() as root:
            ignore = _matches(root)
            for src in srcs:
                if posixpath.normpath(src).startswith("../") or posixpath.normpath(src) == "..":
                    raise BuildError(f"{what}: source {src!r} leaves the context")
                parts = [p for p in posixpath.normpath("/" + src).split("/") if p]
                found = self._expand(root, parts, what)
                if not found:
                    raise BuildError(f"{what}: source {src!r} is not in the context")
                for rel in found:
                    s = self._source(root, rel, "", what)
                    if s.kind == "dir":
                        self._walk(root, rel, "", out, ignore, what)
                    else:
                        single = len(srcs) == 1 and len(found) == 1 and not dest_is_dir
                        out.append(Source(s.rel, "" if single else posixpath.basename(rel), s.kind, s.mode, s.target))
            for s in out:
                h.update(f"{s.rel}\0{s.dest}\0{s.kind}\0{s.mode:o}\0{s.target}\0".encode())
                if s.kind == "file":
                    with self._open_file(root, s.rel) as f:
                        while b := f.read(_CHUNK):
                            h.update(b)
        return out, h.hexdigest()

    def _expand(self, root: int, parts: list[str], what: str) -> list[str]:
        if not parts:
            return [""]
        head, last = parts[:-1], parts[-1]
        fd = _open_dir(root, head, what)
        try:
            names = sorted(os.listdir(fd)) if any(c in last for c in "*?[") else [last]
        finally:
            os.close(fd)
        return ["/".join([*head, n]) for n in names if n == last or fnmatch.fnmatchcase(n, last)]

    def _source(self, root: int, rel: str, dest: str, what: str) -> Source:
        """Context path `rel` as a Source bound for `dest` (its link, if one, read, not followed)."""
        parts = [p for p in rel.split("/") if p]
        fd = _open_dir(root, parts[:-1], what)
        try:
            st = os.lstat(parts[-1], dir_fd=fd) if parts else os.fstat(fd)
            target = os.readlink(parts[-1], dir_fd=fd) if stat.S_ISLNK(st.st_mode) else ""
        except FileNotFoundError:
            raise BuildError(f"{what}: source {rel!r} is not in the context") from None
        finally:
            os.close(fd)
        kind = {stat.S_IFDIR: "dir", stat.S_IFREG: "file", stat.S_IFLNK: "link"}.get(stat.S_IFMT(st.st_mode))
        if kind is None:
            raise BuildError(f"{what}: {rel!r} is a device, socket or FIFO: not copied")
        return Source(rel, dest, kind, stat.S_IMODE(st.st_mode), target)

    def _walk(self, root: int, rel: str, dest: str, out: list[Source], ignore: PatternMatcher | None,
              what: str) -> None:
        """The contents of context directory `rel`, bound for `dest`, parents before children."""
        fd = _open_dir(root, [p for p in rel.split("/") if p], what)
        try:
            names = sorted(os.listdir(fd))
        finally:
            os.close(fd)
        for n in names:
            child = posixpath.join(rel, n)
            if ignore is not None and ignore.matches(child):
                continue
            s = self._source(root, child, posixpath.join(dest, n), what)
            out.append(s)
            if s.kind == "dir":
                self._walk(root, child, s.dest, out, ignore, what)

    @contextlib.contextmanager
    def _open_file(self, root: int, rel: str) -> Iterator:
        parts = rel.split("/")
        pfd = _open_dir(root, parts[:-1], "COPY")
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        finally:
            os.close(pfd)
        with open(fd, "rb") as f:
            yield f

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator:
        """Context file `rel` (from `plan`), open for reading, reached without following a link."""
        with self._fd() as root, self._open_file(root, rel) as f:
            yield f

    def fill(self, tree: Path, dest: str, sources: list[Source], owner: tuple[int, int],
             chmod: int | None) -> None:
        """Write `sources` to `dest` (absolute; a directory unless one source's `dest` is "") in the
        layer `tree`; directories made on the way are marked implied (the lower layer's metadata of
        the same directory stays); the copies are `owner`'s, with `chmod` for a mode if given."""
        parts = [p for p in dest.split("/") if p]
        to_file = any(not s.dest for s in sources)
        base = tree
        for p in parts[:-1] if to_file else parts:
            base = base / p
            if not base.is_dir():
                base.mkdir(0o755)
                os.setxattr(base, IMPLIED, b"1")
        with self._fd() as root:
            for s in sources:
                out = base / s.dest if s.dest else base / parts[-1]
                if s.kind == "dir":
                    out.mkdir()
                elif s.kind == "link":
                    os.symlink(s.target, out)
                else:
                    with self._open_file(root, s.rel) as f, open(out, "xb") as o:
                        while b := f.read(_CHUNK):
                            o.write(b)
                os.chown(out, *owner, follow_symlinks=False)
                if s.kind != "link":
                    os.chmod(out, chmod if chmod is not None else s.mode)
