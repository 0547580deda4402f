"""What the runtime asks of an isolation driver (runc + CRIU today; a Firecracker VM later).

The runtime owns ids, states, the store and persistence; a driver owns processes, mounts and
cgroups of one sandbox at a time and knows nothing of the store. A checkpoint is two directories the
driver fills (`images`: process state; `fs`: the sealed file system diff against the template) and
a restore takes the same two back.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from k3sys.sandbox.spec import SandboxSpec

if TYPE_CHECKING:
    from k3sys.sandbox.runtime.agent import Agent


@dataclass(frozen=True)
class SandboxDirs:
    """Per-sandbox directories under the runtime directory (`root` = `<runtime>/sandboxes/<id>`)."""

    root: Path

    @property
    def bundle(self) -> Path:
        return self.root / "bundle"

    @property
    def rootfs(self) -> Path:
        """The merged view of the sandbox's file system, as mounted on the host."""
        return self.root / "bundle" / "rootfs"

    @property
    def disk(self) -> Path:
        """Where the sandbox's writable file system is mounted (drivers/disk.py), upper and work in it."""
        return self.root / "disk"

    @property
    def upper(self) -> Path:
        return self.disk / "upper"

    @property
    def work(self) -> Path:
        return self.disk / "work"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


@dataclass(frozen=True)
class Images:
    """The process images a restore starts from: their directory, how many bytes of memory they hold
    (`ProcessImages.memory_bytes`; known before they are all there: a driver may prepare for a lazy
    restore), and `wait()`, which returns once they are all in `path` (a checkout may still be
    writing them; it raises if that failed)."""

    path: Path
    page_bytes: int
    wait: Callable[[], None] = lambda: None
    # Where given, the files holding memory in `path` (`ProcessImages.holds_memory`) are files of their
    # size without data, and `read(name, offset, length)` returns their bytes (the driver serves them);
    # `prefetch(name, [(offset, length)])` starts reading ranges that `read` will be asked for.
    read: Callable[[str, int, int], bytes | bytearray] | None = None
    prefetch: Callable[[str, list[tuple[int, int]]], None] | None = None



class ProcessImages(Protocol):
    """How a driver's process images are laid out (CRIU's for runc: drivers/criu_images.py); the
    runtime asks this instead of knowing the format."""

    def holds_memory(self, name: str) -> bool:
        """Whether image file `name` holds the sandbox's memory (read by range, checked out as a hole)."""

    def memory_bytes(self, files: Iterable[tuple[str, int]]) -> int:
        """Bytes of memory among image `files` (name, size)."""

    def complete(self, path: Path) -> Images:
        """The images already all in `path`."""

    def first_reads(self, images: Path) -> dict[str, list[tuple[int, int]]]:
        """Byte ranges (offset, length) per file of `images` that a restore from them reads before the
        sandbox runs (a hibernation has the store start reading them: its resume waits for no disk)."""


class Driver(Protocol):
    """Life cycle of one sandbox's processes; every method may raise `DriverError`."""

    name: str
    images: ProcessImages  # the layout of its process images

    def create(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, lowers: list[Path],
               sealed_bytes: int = 0) -> None:
        """Start a fresh sandbox over `lowers` (top first) with an empty upper; `sealed_bytes` of its
        `disk_mb` are held already by its sealed lower layer (what it wrote before)."""

    def restore(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, lowers: list[Path],
                images: Images, lazy: bool = False, sealed_bytes: int = 0) -> dict[str, float]:
        """Start a sandbox from process `images` over `lowers` (the sealed layer first) with an empty
        upper (`sealed_bytes`: as for `create`); the driver may wait for the images beside its own
        set-up. Returns seconds spent per phase. `lazy`: it may run before all of its memory is back
        (the driver then needs the images until `settle` returns)."""

    def settle(self, sid: str) -> None:
        """Wait until a lazy restore of `sid` has all its memory back (at once if none is under way)."""

    def exec(self, sid: str, argv: list[str], cwd: str, env: dict[str, str],
             stdin: bool) -> tuple[subprocess.Popen, int]:
        """Start `argv` in the sandbox with piped stdio (`runc exec`): only the fallback for a sandbox
        whose agent cannot be reached. Returns the process and the host pid of `argv`."""

    def pause(self, sid: str, dirs: SandboxDirs | None = None) -> None:
        """Freeze every process of the sandbox (memory is kept). With `dirs`, for a dump to come: first
        have its agent drop the host's connections and hold its gate (until a thaw or restore opens
        it), and freeze with no process mid-vfork, so that `snapshot` dumps it without a thaw."""

    def resume(self, sid: str) -> None:
        """Thaw a frozen sandbox."""

    def snapshot(self, sid: str, dirs: SandboxDirs, images: Path, fs: Path, layer: Path | None,
                 *, thaw: bool) -> dict[str, float]:
        """Consistent checkpoint into `images` and `fs` (new directories; `layer` is the sandbox's
        sealed lower layer, if any). The sandbox is left as it was if `thaw`, else frozen (a failed
        snapshot always leaves it as it was). Returns seconds spent per phase."""

    def agent(self, sid: str, dirs: SandboxDirs) -> Agent:
        """The client of the sandbox's agent (its PID 1), the same object for the sandbox's life."""

    def drop_agent(self, sid: str) -> None:
        """Forget a killed sandbox's agent; calls waiting on it fail."""

    def open_socket(self, sid: str, dirs: SandboxDirs, family: socket.AddressFamily) -> socket.socket:
        """A new non-blocking TCP socket inside the sandbox's network namespace (for the host to
        connect to one of its ports), held by its agent's gate: a checkpoint resets it, and the
        caller gives it back with `agent(sid, dirs).release_socket(s)`. Waits while a checkpoint holds the gate."""

    def destroy(self, sid: str, dirs: SandboxDirs) -> None:
        """Kill every process and release mounts and cgroups; safe on a half-created sandbox."""

    def status(self, sid: str) -> str:
        """"running", "paused", "stopped" or "missing"."""

    def memory_bytes(self, sid: str) -> int:
        """Memory charged to the sandbox now (0 when it has no processes)."""

    def cpu_seconds(self, sid: str) -> float:
        """CPU seconds charged to the sandbox's cgroup so far (restarts at 0 with each new cgroup)."""

    def cleanup_stale(self) -> None:
        """Release what a crashed runtime left behind (orphan helper processes, temporary mounts)."""

    def close(self) -> None:
        """Give back what the driver holds ahead of need (disks made ahead); sandboxes keep running."""
