"""User namespaces of sandboxes: one unprivileged host uid/gid range per sandbox, and idmapped
mounts that show the shared, read-only lower layers to it with the right owners.

Ranges: sandbox i of a host gets host ids `BASE + i * SIZE .. + SIZE - 1` for its ids 0..SIZE-1.
A range is claimed by creating `/run/k3sys/userns/<i>` (O_EXCL, content: the sandbox's directory)
and released when the sandbox is destroyed, so claims survive a runtime crash and a restarted
runtime keeps them; all runtimes of a host share the claims.

Owners on disk: templates and sealed layers keep canonical ids (0 = the sandbox's root) and are
never chowned; each sandbox mounts them through an idmapped mount (canonical id k -> host id
base + k), built from a user namespace that holds the range's mapping. The overlay upper is a plain
directory, so what the sandbox writes lands with host ids; `layers.seal` shifts those back to
canonical ids, which keeps every sealed layer (and the store) independent of the range.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import struct
import tempfile
from pathlib import Path

from k3sys.sandbox.errors import DriverError

BASE = 1 << 20  # first host id handed to sandboxes (above the usual /etc/subuid allocations)
SIZE = 65536  # ids per sandbox: 0..65535 inside (nobody = 65534 included)
MAX_RANGES = 4096  # BASE + MAX_RANGES * SIZE stays far below 2^32 - 1

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWUSER = 0x10000000
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # x86_64
_OPEN_TREE_CLONE = 1
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MOUNT_ATTR_IDMAP = 0x100000
_MOVE_MOUNT_F_EMPTY_PATH = 4


class Ranges:
    """Claims of host id ranges, host-wide (every runtime on the host draws from the same ranges):
    one file per claimed range under `dir`, holding the claiming sandbox's directory. A claim whose
    directory is gone (its runtime crashed mid-create, or its directory was deleted) is stale and
    taken over."""

    def __init__(self, dir: Path = Path("/run/k3sys/userns")) -> None:
        self.dir = dir
        dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _claims(self) -> dict[int, str]:
        out = {}
        for p in self.dir.iterdir():
            with contextlib.suppress(OSError):
                if p.name.isdigit():
                    out[int(p.name)] = p.read_text()
        return out

    def claim(self, sandbox: Path) -> int:
        """The first host id of a free range, now claimed for the sandbox whose directory is `sandbox`
        (the range it holds already, if any)."""
        held = self.base_of(sandbox)
        if held is not None:
            return held
        # One claimer at a time, host-wide: a claim being written (empty for a moment) or a stale one
        # being taken over must not be judged by another claimer in between.
        with open(self.dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            claims = self._claims()
            for i in range(MAX_RANGES):
                if i in claims and os.path.isdir(claims[i]):
                    continue
                (self.dir / str(i)).write_text(str(sandbox))  # free, or stale: its sandbox is gone
                return BASE + i * SIZE
        raise DriverError(f"no free uid range: all {MAX_RANGES} are claimed by live sandboxes")

    def base_of(self, sandbox: Path) -> int | None:
        """The first host id of the range the sandbox at `sandbox` claims, None if none."""
        return next((BASE + i * SIZE for i, who in self._claims().items() if who == str(sandbox)), None)

    def release(self, sandbox: Path) -> None:
        base = self.base_of(sandbox)
        if base is not None:
            (self.dir / str((base - BASE) // SIZE)).unlink(missing_ok=True)


def canonical(host_id: int, base: int) -> int:
    """A host id of the range at `base` as the sandbox sees it; ids outside the range become nobody."""
    return host_id - base if base <= host_id < base + SIZE else 65534


def userns_fd(base: int) -> int:
    """A descriptor of a new user namespace mapping ids 0..SIZE-1 to host ids base.. (for idmapped
    mounts; the namespace lives as long as the descriptor). Made by a forked child that only unshares
    and waits, so it is safe in a threaded process."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: async-signal-safe calls only
        try:
            os.close(ready_r)
            os.close(go_w)
            os.write(ready_w, b"1" if _libc.unshare(_CLONE_NEWUSER) == 0 else b"0")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise DriverError("cannot create a user namespace (unshare CLONE_NEWUSER refused)")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 {base} {SIZE}\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(go_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


def mount_idmapped(src: Path, dst: Path, ns_fd: int) -> None:
    """Mount a read-only, nosuid, nodev view of directory `src` at `dst`, its ids shifted by the
    mapping of user namespace `ns_fd` (canonical k -> host base + k)."""
    fd = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(src), _OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        raise DriverError(f"open_tree {src}: {os.strerror(ctypes.get_errno())}")
    try:
        flags = _MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", flags, 0, 0, ns_fd), 32)
        if _libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, attr, 32) != 0:
            err = ctypes.get_errno()
            hint = " (the file system does not support idmapped mounts)" if err == errno.EINVAL else ""
            raise DriverError(f"idmapped mount of {src}: {os.strerror(err)}{hint}")
        if _libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(dst), _MOVE_MOUNT_F_EMPTY_PATH) != 0:
            raise DriverError(f"move_mount {src} -> {dst}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def views(under: Path, lowers: list[Path], ns_fd: int) -> list[Path]:
    """Idmapped views (`mount_idmapped`) of `lowers` at `under/lower-<i>`, in the same order."""
    out = []
    for i, lower in enumerate(lowers):
        view = under / f"lower-{i}"
        view.mkdir(exist_ok=True)
        mount_idmapped(lower, view, ns_fd)
        out.append(view)
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _userns_entry(base: int) -> bytes:
    """CRIU's `userns_entry` protobuf for our single-extent map (uid_map = gid_map = 0 -> base, SIZE)."""
    extent = b"\x08\x00\x10" + _varint(base) + b"\x18" + _varint(SIZE)
    return b"\x0a" + _varint(len(extent)) + extent + b"\x12" + _varint(len(extent)) + extent


def rebase_images(images: Path, dest: Path, base: int) -> None:
    """Fill `dest` (new or empty, on the same file system as `images`): CRIU images that restore into the range
    at `base`, hard links to every image of `images` but the user namespace's, rewritten to map to
    `base` (linked too when it maps there already; none: the sandbox has no user namespace).

    CRIU restores a user namespace with the map it dumped (runc's config is not asked) and keeps
    every other id in the images relative to that namespace, so rewriting the map alone moves a
    restored sandbox (a fork child, a resumed hibernation) to a range of its own. Always another
    directory, so its path is known before the images are (the restore's runc starts first, gate.py).
    """
    found = sorted(images.glob("userns-*.img"))
    rewrite = None
    if found:
        data = found[0].read_bytes()
        old = _range_of(data)
        if old is None or data[12:] != _userns_entry(old):
            raise DriverError(f"{found[0]}: not a user namespace image of a k3sys sandbox (one extent of {SIZE} ids)")
        if old != base:
            if base < BASE:  # never map a sandbox onto host root's ids, whatever went wrong with its claim
                raise DriverError(f"restore into host id {base}: the sandbox holds no uid range")
            rewrite = found[0]
    dest.mkdir(exist_ok=True)  # runc makes its image path (gate.py), and makes it 0600
    dest.chmod(images.stat().st_mode & 0o777)  # CRIU opens images from inside the user namespace too
    for p in images.iterdir():
        if p != rewrite:
            os.link(p, dest / p.name)
    if rewrite is not None:
        entry = _userns_entry(base)
        (dest / rewrite.name).write_bytes(data[:8] + struct.pack("<I", len(entry)) + entry)


def _range_of(data: bytes) -> int | None:
    """The host base id in a userns image of ours: header (two magics, entry length), then
    uid_map's extent `first=0, lower_first=<varint>, count`."""
    prefix = data[12:16]
    if len(data) < 20 or prefix[0] != 0x0A or prefix[2:4] != b"\x08\x00" or data[16] != 0x10:
        return None
    n, shift = 0, 0
    for byte in data[17:23]:
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return n
    return None


def dev_mask(dir: Path) -> Path:
    """A lower layer (made once under `dir`) that hides the template's /dev behind an opaque empty
    one with `pts/` and `shm/`: in a user namespace runc cannot mknod, so it bind-mounts the host's
    null, zero, tty... onto files it creates, and a device node already there (debootstrap leaves
    some) makes that fail (opening /dev/tty gives ENXIO)."""
    layer = dir / "dev-mask"
    if not layer.is_dir():
        # A directory of this call's own: concurrent first creates (threads of one runtime too) race here.
        tmp = Path(tempfile.mkdtemp(prefix=".dev-mask-", dir=dir))
        tmp.chmod(0o755)
        for sub, mode in (("dev", 0o755), ("dev/pts", 0o755), ("dev/shm", 0o1777)):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
            (tmp / sub).chmod(mode)
        os.setxattr(tmp / "dev", "trusted.overlay.opaque", b"y")
        try:
            os.rename(tmp, layer)
        except OSError:  # another runtime made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return layer
