"""CRIU around the driver: its logs (run time, the lines worth an error message), the host processes
and mounts a crashed run leaves, and its private cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from k3sys.sandbox.errors import DriverError


def criu_seconds(log: Path) -> float:
    """CRIU's own run time: the timestamp of the last line of its log (`(00.048150) ...`)."""
    try:
        return float(_tail(log, 200).rstrip().rsplit("\n", 1)[-1].split(")", 1)[0].lstrip("("))
    except ValueError:
        return float("nan")


def log_excerpt(path: Path) -> str:
    """CRIU's error lines and the last lines of its log, for an error message."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if "Error (" in line]
    return "\n".join(errors[:10] + ["..."] + lines[-5:])


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line joined by spaces) for every process we can see."""
    out: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        out[int(entry)] = (ppid, cmd)
    return out


def mounts_matching(fragment: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if fragment in p]


def ensure_kdat_dir() -> None:
    """The tmpfs directory our CRIU build caches kernel facts in (gone after a reboot). It must be
    ours alone: root-owned, mode 0700, a real directory, or CRIU could be fed a forged cache."""
    d = "/dev/shm/k3sys-criu"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        st = os.lstat(d)
        if not (os.path.isdir(d) and not os.path.islink(d) and st.st_uid == 0 and (st.st_mode & 0o077) == 0):
            raise DriverError(f"{d} exists but is not a root-only directory; remove it") from None
