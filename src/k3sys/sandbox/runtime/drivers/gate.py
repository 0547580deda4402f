"""A `runc restore` started before its sandbox is ready.

runc spends ~15 ms of CPU before it needs anything of the sandbox but its bundle: its own start,
reading and checking config.json, and a CRIU version check (a CRIU run of its own). A resume spends
about as long mounting the sandbox's file system and writing the pages CRIU restores itself. So the
driver starts runc as soon as the bundle is written, with `k3sys-criu-gate` as its CRIU
(scripts/sandbox/k3sys-criu-gate.c): each CRIU run waits on a FIFO for a byte from the driver,
which `Gate.open` writes once the mounts and images are ready. `close` before `open` makes every
run fail, so runc gives up at its version check, before it has touched the sandbox; the driver's
death does the same (the FIFO loses its only writer).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

NAME = "criu.gate"
# CRIU runs one `runc restore` makes (runc 1.1: a version check, then the restore), with room to spare:
# bytes nobody reads are dropped with the FIFO.
RUNS = 8


class Gate:
    """The FIFO `<work>/criu.gate` holding the CRIU runs of one runc until `open`; `env`: what that
    runc's environment needs for k3sys-criu-gate to find it and the real CRIU."""

    def __init__(self, work: Path, criu: Path) -> None:
        self.path = work / NAME
        self.path.unlink(missing_ok=True)  # a crashed runtime's
        os.mkfifo(self.path, 0o600)
        # Read and write: opening never waits for a reader, and the FIFO has a writer (the only
        # one: not inherited by children) until `close`.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self.env = {"K3SYS_CRIU": str(criu), "K3SYS_CRIU_GATE": str(self.path)}

    def open(self) -> None:
        """Let runc's CRIU runs go."""
        os.write(self._fd, b"g" * RUNS)

    def close(self) -> None:
        """Drop the FIFO: runs still waiting (the gate was never opened) fail. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
