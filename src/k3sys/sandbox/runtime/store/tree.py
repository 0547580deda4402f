"""Directory trees to entries and back: type, mode, owner, mtime, xattrs, devices, symlinks.

Scanning never follows a symlink (links are recorded, not traversed); rebuilding creates every
entry inside a directory it created itself, so a manifest cannot make it write outside the
destination (no `..`, no absolute paths, no writing through a symlink it just made).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from k3sys.sandbox.errors import StoreInputError
from k3sys.sandbox.runtime.store.manifest import Entry

_KIND_OF = {stat.S_IFDIR: "dir", stat.S_IFREG: "file", stat.S_IFLNK: "symlink", stat.S_IFCHR: "chr",
            stat.S_IFBLK: "blk", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "sock"}
_IFMT_OF = {"chr": stat.S_IFCHR, "blk": stat.S_IFBLK, "fifo": stat.S_IFIFO, "sock": stat.S_IFSOCK}
# Errors that mean "this xattr cannot be read", as opposed to a broken file system.
_XATTR_SKIP = {errno.ENODATA, errno.EPERM, errno.EACCES}


def read_xattrs(path: str | int) -> tuple[tuple[str, bytes], ...]:
    """All extended attributes of `path` (a symlink itself, not its target) that we may read."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EPERM):
            return ()
        raise
    out = []
    for name in sorted(names):
        try:
            out.append((name, os.getxattr(path, name, follow_symlinks=False)))
        except OSError as e:
            if e.errno not in _XATTR_SKIP:
                raise
    return tuple(out)


def _entry(rel: str, path: str, st: os.stat_result) -> Entry:
    kind = _KIND_OF.get(stat.S_IFMT(st.st_mode))
    if kind is None:
        raise StoreInputError(f"{path!r}: unsupported file type {stat.S_IFMT(st.st_mode):o}")
    return Entry(
        rel, kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns,
        size=st.st_size if kind == "file" else 0,
        target=os.readlink(path) if kind == "symlink" else "",
        rdev=(os.major(st.st_rdev), os.minor(st.st_rdev)) if kind in ("chr", "blk") else (0, 0),
        xattrs=read_xattrs(path),
    )


def scan(root: Path) -> list[tuple[Entry, str]]:
    """Entries of the tree at `root` in pre-order (parents first, names sorted), each with its path.

    `root` itself may be a symlink to a directory; nothing below it is followed. Regular files
    come back with `size` set and no chunks yet.
    """
    top = os.path.realpath(root)
    try:
        st = os.stat(top)
    except OSError as e:
        raise StoreInputError(f"tree {os.fspath(root)!r}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise StoreInputError(f"tree {os.fspath(root)!r} is not a directory")
    out = [(_entry(".", top, st), top)]

    def walk(rel_dir: str, abs_dir: str) -> None:
        with os.scandir(abs_dir) as it:
            children = sorted(it, key=lambda d: d.name)
        for d in children:
            e = _entry(rel_dir + d.name, d.path, d.stat(follow_symlinks=False))
            out.append((e, d.path))
            if e.kind == "dir":
                walk(e.path + "/", d.path)

    walk("", top)
    return out


def check_path(path: str) -> None:
    """Raise `StoreInputError` unless `path` is a normalised relative path (no `..`, `.`, `//`, leading `/`)."""
    parts = path.split("/")
    if not path or "\x00" in path or any(p in ("", ".", "..") for p in parts):
        raise StoreInputError(f"entry path {path!r} is not a normalised path inside the tree")


def prepare_dest(dest: Path) -> bool:
    """Make `dest` an empty directory; return whether it was created (so a failure can remove it)."""
    d = os.fspath(dest)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        os.makedirs(d)
        return True
    if not stat.S_ISDIR(st.st_mode):
        raise StoreInputError(f"destination {d!r} exists and is not a directory")
    if any(True for _ in os.scandir(d)):
        raise StoreInputError(f"destination {d!r} is not empty")
    return False


def discard_dest(dest: Path, created: bool) -> None:
    """Undo a failed checkout: remove `dest` if we created it, else empty it again."""
    d = os.fspath(dest)
    if created:
        shutil.rmtree(d, ignore_errors=True)
        return
    for child in os.scandir(d):
        if child.is_dir(follow_symlinks=False):
            shutil.rmtree(child.path, ignore_errors=True)
        else:
            os.unlink(child.path)


def _apply_meta(target: str | int, e: Entry) -> None:
    """Owner, mode, xattrs and mtime of `e` onto `target` (an open fd, or a path never followed)."""
    nofollow = {} if isinstance(target, int) else {"follow_symlinks": False}
    # Order matters: chown clears set-id bits and file capabilities, so chmod and xattrs come after.
    os.chown(target, e.uid, e.gid, **nofollow)
    if e.kind != "symlink":  # Linux has no lchmod; a symlink's mode is always 0777
        os.chmod(target, e.mode)
    for name, value in e.xattrs:
        try:
            os.setxattr(target, name, value, **nofollow)
        except OSError as err:
            raise StoreInputError(f"entry {e.path!r}: cannot set xattr {name!r}: {err.strerror}") from err
    os.utime(target, ns=(e.mtime_ns, e.mtime_ns), **nofollow)


def build(dest: Path, entries: Iterable[Entry], fill: Callable[[int, Entry], None]) -> None:
    """Create `entries` under the empty directory `dest`; `fill(fd, entry)` writes a file's bytes.

    Every entry's parent must be a directory this call created earlier in `entries` (pre-order),
    which is what keeps a hostile manifest inside `dest`. Directory metadata is applied last,
    deepest first, so creating children does not disturb their parents' mtimes or permissions.
    """
    root = os.fspath(dest)
    dirs: dict[str, Entry | None] = {".": None}
    for e in entries:
        if e.path == ".":
            if e.kind != "dir":
                raise StoreInputError(f"root entry is a {e.kind}, expected a dir")
            dirs["."] = e
            continue
        check_path(e.path)
        parent = e.path.rpartition("/")[0] or "."
        if parent not in dirs:
            raise StoreInputError(f"entry {e.path!r}: parent {parent!r} is not a directory created earlier in the tree")
        path = os.path.join(root, e.path)
        try:
            if e.kind == "dir":
                os.mkdir(path, 0o700)
                dirs[e.path] = e
            elif e.kind == "file":
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    fill(fd, e)
                    _apply_meta(fd, e)
                finally:
                    os.close(fd)
            elif e.kind == "symlink":
                os.symlink(e.target, path)
                _apply_meta(path, e)
            else:
                os.mknod(path, 0o600 | _IFMT_OF[e.kind], os.makedev(*e.rdev))
                _apply_meta(path, e)
        except FileExistsError as err:
            raise StoreInputError(f"entry {e.path!r} appears twice in the tree") from err
    for rel, e in reversed(dirs.items()):
        if e is not None:
            _apply_meta(os.path.join(root, rel) if rel != "." else root, e)
