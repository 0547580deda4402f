"""One image layer's tar, unpacked safely into an empty directory in overlay's encoding.

A layer comes from whoever made the image, so every entry is an attacker's until checked:

- its path must be relative and free of `..` (an absolute path or `..` is refused, never cleaned up:
  a tar that says `../etc/passwd` is not a tar we want half of);
- it is created relative to a descriptor of its parent directory, reached one component at a time
  with O_NOFOLLOW: a parent that is a symbolic link (one an earlier entry of the layer made, say
  `lib -> /etc`, then `lib/passwd`) or not a directory is refused, so nothing is written through a link;
- a hard link must name a file this layer already holds (same path rules); never a directory or a
  device;
- device nodes are refused (the sandbox's overlay is `nodev` anyway; a template has no use for them),
  except under `dev/`, where they are skipped: images made by debootstrap carry /dev's standard
  nodes, and a sandbox gets its /dev from runc;
- whiteouts (`.wh.NAME`, `.wh..wh..opq`) become overlay's: a 0/0 character device NAME and
  `trusted.overlay.opaque=y` on the directory; the whited-out NAME must be a plain name;
- only `user.*` and `security.capability` extended attributes are kept (a layer setting
  `trusted.overlay.*` would speak to overlayfs in our place);
- headers are bounded (`MAX_HEADER`): a 1 GiB pax header does not become 1 GiB of host memory, and
  no header is kept once its entry is written (ten million empty entries cost no more memory than one).

Each refusal is a `LayerEntryError` naming the layer and the entry. Owners are kept numerically
(canonical ids: 0 is the sandbox's root, drivers/idmap.py), modes with their setuid bits (the
sandbox's mounts are nosuid on the host), times as the tar says.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import BinaryIO

from k3sys.sandbox.errors import LayerEntryError

OPAQUE = "trusted.overlay.opaque"
# Marks a directory made only because an entry below it needed a parent: composing keeps the
# metadata of the same directory in a lower layer (/tmp stays 1777 under a layer that adds /tmp/x).
IMPLIED = "trusted.k3sys.implied"
WHITEOUT, OPAQUE_MARKER, META_PREFIX = ".wh.", ".wh..wh..opq", ".wh..wh."
MAX_HEADER = 1 << 20  # bytes: a GNU long name or pax header past this is refused
MAX_DIR_TIMES = 1 << 20  # directories whose times are set at the end; past this they keep the unpack's
_KEEP_XATTR = ("user.", "security.capability")
_CHUNK = 1 << 20
_DIR_OPEN = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a long-name or pax header whole into memory: refuse one past MAX_HEADER first."""

    def _proc_gnulong(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        self._bound()
        return super()._proc_gnulong(tf)

    def _proc_pax(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        self._bound()
        return super()._proc_pax(tf)

    def _bound(self) -> None:
        if self.size > MAX_HEADER:
            raise LayerEntryError(f"a tar header of {self.size} bytes (over {MAX_HEADER})")


def split_entry(name: str, what: str = "entry") -> list[str]:
    """The components of tar path `name` (a leading `./` dropped); LayerEntryError for an absolute
    path, a `..`, a NUL or an empty component in the middle."""
    if name.startswith("/"):
        raise LayerEntryError(f"{what} {name!r}: absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LayerEntryError(f"{what} {name!r}: '..' in the path")
    if "\0" in name:
        raise LayerEntryError(f"{what} {name!r}: NUL in the path")
    return parts


class _Layer:
    """The destination of one layer: its root descriptor and the directories' times set at the end."""

    def __init__(self, dest: Path, label: str) -> None:
        self.root = os.open(dest, _DIR_OPEN)
        self.label = label
        self.dir_times: list[tuple[list[str], float]] = []

    def fail(self, entry: str, why: str) -> LayerEntryError:
        return LayerEntryError(f"layer {self.label}: entry {entry!r}: {why}")

    def parent(self, parts: list[str], entry: str, create: bool = True) -> int:
        """A descriptor of the directory holding `parts[-1]`, walked without following a link
        (missing directories made 0755 root, as docker does, when `create`)."""
        fd = os.dup(self.root)
        try:
            for i, p in enumerate(parts[:-1]):
                try:
                    nxt = os.open(p, _DIR_OPEN, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise self.fail(entry, f"{'/'.join(parts[:i + 1])!r} is not in this layer") from None
                    os.mkdir(p, 0o755, dir_fd=fd)
                    nxt = os.open(p, _DIR_OPEN, dir_fd=fd)
                    os.setxattr(f"/proc/self/fd/{nxt}", IMPLIED, b"1")
                except OSError:  # ELOOP / ENOTDIR: a symbolic link or a file where a directory must be
                    raise self.fail(entry, f"{'/'.join(parts[:i + 1])!r} is a symbolic link or not a "
                                           "directory: nothing is written through it") from None
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        for parts, mtime in reversed(self.dir_times):  # children first: their times are final
            # A directory a later entry replaced (or put under a link) keeps the time it has.
            with contextlib.suppress(OSError, LayerEntryError):
                pfd = self.parent(parts, "/".join(parts), create=False) if parts else os.dup(self.root)
                try:
                    os.utime(parts[-1] if parts else ".", (mtime, mtime), dir_fd=pfd, follow_symlinks=False)
                finally:
                    os.close(pfd)
        os.close(self.root)


def _remove(name: str, dfd: int) -> None:
    """Remove whatever `name` is in directory `dfd` (a later entry replaces an earlier one)."""
    try:
        st = os.lstat(name, dir_fd=dfd)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def _meta(ti: tarfile.TarInfo, name: str, dfd: int, fd: int | None = None) -> None:
    """Owner, mode and times of entry `ti` onto `name` in `dfd`, or onto the regular file open as
    `fd` (then its kept xattrs too: `security.capability` matters on executables only)."""
    if fd is not None:
        os.fchown(fd, ti.uid, ti.gid)
        os.fchmod(fd, ti.mode & 0o7777)
        for key, value in ti.pax_headers.items():
            if key.startswith("SCHILY.xattr.") and key[13:].startswith(_KEEP_XATTR):
                os.setxattr(fd, key[13:], value.encode("utf-8", "surrogateescape"))
        os.utime(fd, (ti.mtime, ti.mtime))
        return
    os.chown(name, ti.uid, ti.gid, dir_fd=dfd, follow_symlinks=False)
    if not ti.issym():
        os.chmod(name, ti.mode & 0o7777, dir_fd=dfd)  # a directory or FIFO we just made: no link
    if not ti.isdir():  # directories get theirs at the end (their children change them)
        os.utime(name, (ti.mtime, ti.mtime), dir_fd=dfd, follow_symlinks=False)


def _entry(layer: _Layer, tf: tarfile.TarFile, ti: tarfile.TarInfo) -> None:
    parts = split_entry(ti.name)
    entry = ti.name
    if not parts:
        if not ti.isdir():
            raise layer.fail(entry, "the layer's root as a non-directory")
        return  # the root's own metadata is the template's, not a layer's
    base = parts[-1]
    if base.startswith(WHITEOUT) and not ti.isdir():
        return _whiteout(layer, parts, entry)
    if ti.ischr() or ti.isblk():
        if parts[0] == "dev":
            return  # images made by debootstrap carry /dev's nodes; a sandbox gets its /dev from runc
        raise layer.fail(entry, f"device node {ti.devmajor}:{ti.devminor}: refused")
    if ti.issparse():
        raise layer.fail(entry, "sparse file: not supported")
    if not (ti.isdir() or ti.isreg() or ti.issym() or ti.islnk() or ti.isfifo()):
        raise layer.fail(entry, f"tar type {ti.type!r}: refused")
    dfd = layer.parent(parts, entry)
    try:
        if ti.isdir():
            try:
                keep = stat.S_ISDIR(os.lstat(base, dir_fd=dfd).st_mode)
            except FileNotFoundError:
                keep = False
            if not keep:
                _remove(base, dfd)
                os.mkdir(base, 0o700, dir_fd=dfd)
            else:
                with contextlib.suppress(OSError):  # named by an entry of its own now
                    os.removexattr(f"/proc/self/fd/{dfd}/{base}", IMPLIED)
            _meta(ti, base, dfd)
            if len(layer.dir_times) < MAX_DIR_TIMES:
                layer.dir_times.append((parts, ti.mtime))
        elif ti.isreg():
            _remove(base, dfd)
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                src = tf.extractfile(ti)
                assert src is not None
                while chunk := src.read(_CHUNK):
                    os.write(fd, chunk)  # a regular file we made: short writes do not happen
                _meta(ti, base, dfd, fd)
            finally:
                os.close(fd)
        elif ti.issym():
            _remove(base, dfd)
            os.symlink(ti.linkname, base, dir_fd=dfd)  # any target: it is read inside the sandbox only
            _meta(ti, base, dfd)
        elif ti.islnk():
            _hardlink(layer, parts, ti.linkname, dfd, entry)
        else:
            _remove(base, dfd)
            os.mkfifo(base, 0o600, dir_fd=dfd)
            _meta(ti, base, dfd)
    except OSError as e:
        raise layer.fail(entry, f"{e.strerror or e}") from None
    finally:
        os.close(dfd)


def _hardlink(layer: _Layer, parts: list[str], linkname: str, dfd: int, entry: str) -> None:
    target = split_entry(linkname, "hard link target")
    if not target:
        raise layer.fail(entry, "hard link to the layer's root")
    tfd = layer.parent(target, entry, create=False)
    try:
        try:
            st = os.lstat(target[-1], dir_fd=tfd)
        except FileNotFoundError:
            raise layer.fail(entry, f"hard link to {linkname!r}, which is not in this layer") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise layer.fail(entry, f"hard link to {linkname!r}, which is not a file")
        if target == parts:
            return
        _remove(parts[-1], dfd)
        os.link(target[-1], parts[-1], src_dir_fd=tfd, dst_dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(tfd)


def _whiteout(layer: _Layer, parts: list[str], entry: str) -> None:
    base = parts[-1]
    if base == OPAQUE_MARKER:
        if len(parts) == 1:
            return  # the layer's root is opaque to nothing: the template root has no lower
        dfd = layer.parent(parts, entry)
        try:
            os.setxattr(f"/proc/self/fd/{dfd}", OPAQUE, b"y")  # O_PATH fd of the directory itself
        finally:
            os.close(dfd)
        return
    if base.startswith(META_PREFIX):
        return  # aufs' own bookkeeping (`.wh..wh.plnk`, ...): docker ignores it too
    name = base[len(WHITEOUT):]
    if name in ("", ".", ".."):
        raise layer.fail(entry, f"whiteout of {name!r}: not a plain name")
    dfd = layer.parent(parts, entry)
    try:
        _remove(name, dfd)
        os.mknod(name, 0o600 | stat.S_IFCHR, os.makedev(0, 0), dir_fd=dfd)  # overlay's whiteout
    except OSError as e:
        raise layer.fail(entry, f"{e.strerror or e}") from None
    finally:
        os.close(dfd)


def unpack_layer(stream: BinaryIO, dest: Path, label: str) -> None:
    """Unpack the uncompressed layer tar read from `stream` into the empty directory `dest` (see the
    module docstring); `label` names the layer in errors (its digest)."""
    layer = _Layer(dest, label)
    try:
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_BoundedTarInfo) as tf:
            while (ti := tf.next()) is not None:
                _entry(layer, tf, ti)
                tf.members.clear()  # tarfile keeps every header it read: memory would grow per entry
    except LayerEntryError as e:
        if str(e).startswith("layer "):
            raise
        raise LayerEntryError(f"layer {label}: {e}") from None
    except tarfile.TarError as e:
        raise LayerEntryError(f"layer {label}: not a tar stream: {e}") from None
    finally:
        layer.close()
