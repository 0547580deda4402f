"""A sandbox's writable layer on a file system of its own, `disk_mb` large (docs/sandbox-security.md).

Each sandbox's overlay upper and work directories live on an ext4 file system in a sparse image file
(`<sandbox>/disk.img`) attached to a loop device: writes past `disk_mb` get ENOSPC inside, `df`
inside shows the quota (overlayfs reports its upper's file system), the host loses at most
`disk_mb` (plus a little ext4 metadata), and killing the sandbox gives everything back (unmount, the
loop device detaches itself, the image is deleted). Deleted files free host space at once (`discard`
punches holes into the image). What the sandbox wrote before its last hibernation, restore or fork
(its sealed lower layer) is reserved on its new disk (`reserve`), so `disk_mb` bounds both together.

This kernel has no disk quotas (no CONFIG_QUOTA, no XFS quota), so one file system per sandbox is
the way to a hard limit. To keep it cheap, `mkfs` runs once per size: a formatted image is cached
and each sandbox gets a sparse copy of it (about 1 MiB of metadata), attached with LOOP_CONFIGURE
and mounted with mount(2) directly (no mount(8) or losetup(8) processes).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import struct
import subprocess
import time
from pathlib import Path

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime import layers

_libc = ctypes.CDLL(None, use_errno=True)
_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE = 0x4C82, 0x4C0A
_LO_FLAGS_AUTOCLEAR, _LO_FLAGS_DIRECT_IO = 4, 16
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
RESERVED = "sealed"  # the file `reserve` allocates, beside upper/ and work/ (out of the sandbox's sight)
_SLACK = 1 << 20  # bytes `reserve` leaves free at least: whiteouts and copied-up directories need some
# No journal: a sandbox's upper does not outlive a host crash (its processes do not either, and
# checkpoints are sealed copies); no reserved blocks: the sandbox gets all of disk_mb.
_MKFS = ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", "-E", "lazy_itable_init=1,nodiscard"]


def blank(cache: Path, mb: int) -> Path:
    """A formatted, empty image of `mb` MiB under `cache`, made once per size."""
    image = cache / f"ext4-{mb}.img"
    if image.exists():
        return image
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = cache / f".ext4-{mb}.{os.getpid()}.{time.monotonic_ns()}"
    try:
        with open(tmp, "wb") as f:
            f.truncate(mb << 20)
        p = subprocess.run([*_MKFS, str(tmp)], capture_output=True, text=True)
        if p.returncode != 0:
            raise DriverError(f"mkfs.ext4 failed ({p.returncode}): {p.stderr.strip()} (scripts/install-sandbox.sh)")
        os.replace(tmp, image)  # a concurrent maker wrote the same thing
    finally:
        tmp.unlink(missing_ok=True)
    return image


def _attach(image: Path) -> tuple[str, int]:
    """Attach `image` to a free loop device (auto-clearing: it detaches once unmounted); returns the
    device's path and an open descriptor on it (close it once mounted)."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(64):  # another process may take the free device between the two calls
            dev = f"/dev/loop{fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)}"
            loop = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            info = struct.pack("5Q4I64s64s32s2Q", 0, 0, 0, 0, 0, 0, 0, 0,
                               _LO_FLAGS_AUTOCLEAR | _LO_FLAGS_DIRECT_IO, b"", b"", b"", 0, 0)
            try:
                fcntl.ioctl(loop, _LOOP_CONFIGURE, struct.pack("II", backing, 0) + info + bytes(64))
                return dev, loop
            except OSError as e:
                os.close(loop)
                if e.errno != errno.EBUSY:
                    raise DriverError(f"cannot attach {image} to {dev}: {e.strerror}") from e
        raise DriverError(f"cannot attach {image}: no free loop device")
    finally:
        os.close(backing)
        os.close(ctl)


def make(cache: Path, image: Path, mb: int) -> tuple[str, int]:
    """A fresh `mb` MiB file system in the new file `image`, attached: the device's path and an open
    descriptor on it (`mount` it, or close the descriptor to detach it)."""
    layers.sparse_copy(blank(cache, mb), image)
    return _attach(image)


def mount(dev: str, loop: int, target: Path) -> None:
    """Mount the file system on `dev` at `target` (nosuid, nodev, discard) and close `loop`."""
    try:
        target.mkdir(exist_ok=True)
        if _libc.mount(dev.encode(), os.fsencode(target), b"ext4", _MS_NOSUID | _MS_NODEV, b"discard") != 0:
            raise DriverError(f"mount {dev} at {target}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(loop)  # the mount holds the device now; without one, auto-clear detaches it


def create(cache: Path, image: Path, target: Path, mb: int) -> None:
    """A fresh `mb` MiB file system in `image`, mounted at `target` (nosuid, nodev, discard)."""
    mount(*make(cache, image, mb), target)


def reserve(target: Path, nbytes: int) -> int:
    """Take `nbytes` of the file system mounted at `target` for what its sandbox already wrote and
    sealed (its lower layer, `layers.tree_bytes`): a file beside the upper, allocated but never
    written (the image stays sparse), so `df` inside shows it used and writes past `disk_mb` get
    ENOSPC across hibernation, restore and fork. A layer charged more than the disk holds (the
    charge rounds up; this disk's blocks may be smaller) leaves `_SLACK` free to delete files with.
    Returns the bytes reserved."""
    if nbytes <= 0:
        return 0
    vfs = os.statvfs(target)
    n = min(nbytes, max(0, vfs.f_bavail * vfs.f_frsize - _SLACK))
    if n:
        fd = os.open(target / RESERVED, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, n)
        except OSError as e:
            raise DriverError(f"cannot reserve {n} bytes of the sandbox's disk at {target}: {e.strerror}") from e
        finally:
            os.close(fd)
    return n


def remove(image: Path, target: Path) -> None:
    """Unmount `target` (lazily if busy) and delete `image`; the loop device detaches itself."""
    if _libc.umount2(os.fsencode(target), 0) != 0 and ctypes.get_errno() == errno.EBUSY:
        _libc.umount2(os.fsencode(target), _MNT_DETACH)
    image.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        target.rmdir()
