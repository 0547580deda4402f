"""A sandbox's writable layer on a file system of its own, `disk_mb` large (docs/sandbox-security.md).

Each sandbox's overlay upper and work directories live on an ext4 file system in a sparse image file
(`<sandbox>/disk.img`) attached to a loop device: writes past `disk_mb` get ENOSPC inside, `df`
inside shows the quota (overlayfs reports its upper's file system), the host loses at most
`disk_mb` (plus a little ext4 metadata), and killing the sandbox gives everything back (unmount, the
loop device detaches itself, the image is deleted). Deleted files free host space at once (`discard`
punches holes into the image).

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

_libc = ctypes.CDLL(None, use_errno=True)
_LOOP_CTL_GET_FREE, _LOOP_CONFIGURE = 0x4C82, 0x4C0A
_LO_FLAGS_AUTOCLEAR, _LO_FLAGS_DIRECT_IO = 4, 16
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
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


def _sparse_copy(src: Path, dst: Path) -> None:
    """Copy `src` to the new file `dst`, holes kept as holes."""
    with open(src, "rb") as s, open(dst, "xb") as d:
        size, off = os.fstat(s.fileno()).st_size, 0
        while off < size:
            try:
                start = os.lseek(s.fileno(), off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole left
                    break
                raise
            end = os.lseek(s.fileno(), start, os.SEEK_HOLE)
            while start < end:
                start += os.copy_file_range(s.fileno(), d.fileno(), end - start, start, start)
            off = end
        os.ftruncate(d.fileno(), size)


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
    _sparse_copy(blank(cache, mb), image)
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


def remove(image: Path, target: Path) -> None:
    """Unmount `target` (lazily if busy) and delete `image`; the loop device detaches itself."""
    if _libc.umount2(os.fsencode(target), 0) != 0 and ctypes.get_errno() == errno.EBUSY:
        _libc.umount2(os.fsencode(target), _MNT_DETACH)
    image.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        target.rmdir()
