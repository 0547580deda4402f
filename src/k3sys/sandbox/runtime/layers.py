"""Overlay layers: a sandbox's root is read-only lowers plus its own writable upper.

Lowers, top first: at most one sealed layer (the file system of the checkpoint the sandbox was
restored from) and the template. A sealed layer is self-contained relative to the template: `seal`
flattens "sealed layer + upper" into one new tree, so no sandbox ever stacks more than two lowers,
however many times it is checkpointed and restored. Overlay's own encoding is kept in sealed trees
(a whiteout is a 0/0 character device, an opaque directory has `trusted.overlay.opaque=y`), so a
sealed tree works directly as a lower layer and as a store tree.

A sealed layer counts against its sandbox's `disk_mb` (`tree_bytes`, docs/sandbox-security.md
"Quotas"): it is what the sandbox wrote, kept in the host's layers directory and the store.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from pathlib import Path

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime.drivers.idmap import canonical

_OPAQUE = "trusted.overlay.opaque"
BLOCK = 4096  # bytes: what `tree_bytes` charges at least, per file system object
_MNT_DETACH = 2
_MS_NOSUID, _MS_NODEV, _MS_BIND = 2, 4, 4096
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise DriverError(f"{what}: {os.strerror(err)}")


def mount_overlay(lowers: list[Path], upper: Path, work: Path, target: Path, nodev: bool = True) -> None:
    """Mount `lowers` (top first) + `upper` at `target`, nosuid (and nodev unless `nodev` is False):
    the host never runs a sandbox's setuid file or opens its device node through this mount (nor
    through its binds, which keep these flags, runc's root included).

    redirect_dir and metacopy stay off so the upper holds plain files, whiteouts and opaque
    directories only, which is all `seal` understands (a renamed lower directory is copied up).
    """
    opts = (f"lowerdir={':'.join(map(str, lowers))},upperdir={upper},workdir={work},"
            "redirect_dir=off,metacopy=off,index=off")
    flags = _MS_NOSUID | (_MS_NODEV if nodev else 0)
    _check(_libc.mount(b"overlay", os.fsencode(target), b"overlay", flags, opts.encode()),
           f"mount overlay at {target}")


def bind(source: Path, target: Path) -> None:
    """Bind-mount directory `source` (not what is mounted below it) at `target`."""
    _check(_libc.mount(os.fsencode(source), os.fsencode(target), None, _MS_BIND, None), f"bind {source} at {target}")


def unmount(target: Path) -> None:
    """Unmount `target`; detach lazily if busy. A target that is not mounted is fine."""
    if _libc.umount2(os.fsencode(target), 0) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
        return
    _check(_libc.umount2(os.fsencode(target), _MNT_DETACH), f"unmount {target}")


def _copy_meta(src: str, dst: str, st: os.stat_result, uid_base: int = 0) -> None:
    """Owner, mode, xattrs (overlay's bookkeeping dropped, except opacity) and times of `src` onto `dst`;
    with `uid_base`, owners are shifted from that sandbox's host id range to canonical ids (idmap.py)."""
    uid, gid = st.st_uid, st.st_gid
    if uid_base:
        uid, gid = canonical(uid, uid_base), canonical(gid, uid_base)
    os.chown(dst, uid, gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        if name.startswith("trusted.overlay.") and name != _OPAQUE:
            continue  # origin / impure markers refer to the live mount, meaningless in a sealed tree
        os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def remove_entry(path: str) -> None:
    """Remove what is at `path` (a directory with its contents), never following a link; nothing there: done."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def sparse_copy(src: str | Path, dst: str | Path) -> None:
    """Copy regular file `src` to the new file `dst`, holes kept as holes: a sandbox's sparse file
    (`truncate -s 1T` fits any disk) must not become that many bytes of zeros on the host. A link
    at `src` is not followed."""
    with open(os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as s, open(dst, "xb") as d:
        fi, fo = s.fileno(), d.fileno()
        size, off = os.fstat(fi).st_size, 0
        while off < size:
            try:
                start = os.lseek(fi, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole left
                    break
                raise
            end = os.lseek(fi, start, os.SEEK_HOLE)
            while start < end:
                try:
                    n = os.copy_file_range(fi, fo, end - start, start, start)
                except OSError as e:
                    if e.errno != errno.EXDEV:
                        raise
                    os.lseek(fo, start, os.SEEK_SET)  # another file system: sendfile copies across
                    n = os.sendfile(fo, fi, start, end - start)
                if n == 0:  # the source shrank under us
                    break
                start += n
            off = end
        os.ftruncate(fo, size)


def tree_bytes(root: Path) -> int:
    """Bytes a sealed tree is charged against its sandbox's disk: per file system object (each inode
    once, however many names it has), its data bytes (holes excluded) rounded up to `BLOCK`, and at
    least one `BLOCK`, so a tree of empty files or links is bounded by the disk as data is."""
    total, seen, todo = 0, set(), [os.fspath(root)]
    while todo:  # no recursion: a sandbox's tree can be any depth
        with os.scandir(todo.pop()) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                data = min(st.st_size, st.st_blocks * 512)
                total += max(BLOCK, -(-data // BLOCK) * BLOCK)
                if stat.S_ISDIR(st.st_mode):
                    todo.append(e.path)
    return total


def _copy_entry(src: str, dst: str, st: os.stat_result, uid_base: int) -> None:
    """Copy one non-directory entry (file, symlink, whiteout or other special file)."""
    if stat.S_ISREG(st.st_mode):
        sparse_copy(src, dst)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    else:
        os.mknod(dst, st.st_mode, st.st_rdev)
    _copy_meta(src, dst, st, uid_base)


def link_tree(src: str, dst: str) -> None:
    """`dst` := a copy of the immutable tree `src`: directories recreated, everything else hard-linked."""
    os.mkdir(dst)
    with os.scandir(src) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                link_tree(e.path, os.path.join(dst, e.name))
            else:
                os.link(e.path, os.path.join(dst, e.name), follow_symlinks=False)
    _copy_meta(src, dst, os.lstat(src))  # after the children, which would bump its mtime


def _apply_upper(upper: str, out: str, uid_base: int) -> None:
    """Overlay the live upper directory `upper` onto the sealed copy `out` (same relative path)."""
    with os.scandir(upper) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        src, dst = e.path, os.path.join(out, e.name)
        st = e.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            opaque = _OPAQUE in os.listxattr(src, follow_symlinks=False)
            try:
                keep = stat.S_ISDIR(os.lstat(dst).st_mode) and not opaque
            except FileNotFoundError:
                keep = False
            if not keep:
                remove_entry(dst)
                os.mkdir(dst)
            _apply_upper(src, dst, uid_base)
            _copy_meta(src, dst, st, uid_base)
        else:
            # A whiteout stays a whiteout: the template below may still have this path.
            remove_entry(dst)
            _copy_entry(src, dst, st, uid_base)


def seal(upper: Path, dest: Path, layer: Path | None = None, uid_base: int = 0) -> None:
    """Write the sandbox's file system diff against its template into the new directory `dest`.

    `upper` is the live upper (the sandbox must be stopped or frozen); `layer`, when the sandbox
    runs over a sealed layer, is that layer, whose files are hard-linked rather than copied (sealed
    trees are never modified). `dest` then serves as the next sealed layer. `uid_base`: the first host
    id of the sandbox's range when it runs in a user namespace (sealed trees keep canonical owners).
    """
    if layer is not None:
        link_tree(str(layer), str(dest))
    else:
        os.mkdir(dest)
    _apply_upper(str(upper), str(dest), uid_base)
    _copy_meta(str(upper), str(dest), os.lstat(upper), uid_base)
