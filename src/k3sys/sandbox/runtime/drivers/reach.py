"""What runc opens from inside a sandbox's user namespace (the sandbox's root, the sources of its
binds) must be reachable by the sandbox's own host uid, and by no other host user.

The runtime directory is private (0700 root: no host uid of a sandbox reaches into it), so each
sandbox gets a directory of its own under `/run/k3sys/<hash of the state dir>` (0711: searchable,
not listable), `<sandbox id>/`, mode 0700 and owned by the sandbox's mapped root (its range's first
host id; host root for a sandbox without a user namespace): runc, as that uid, traverses it; no
other host user (another sandbox's uid, `nobody`) can. It holds `root`, where the sandbox's overlay
is bound (nosuid, nodev, as the overlay is mounted), and the files runc binds into the sandbox
(`resolv.conf`). Made while a sandbox is being prepared, removed with it; the hash directory goes
with the last one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

from k3sys.sandbox.runtime import layers


class Reachable:
    """`/run/k3sys/<hash>`: `empty/` (bind source of masked directories) and `<sandbox id>/` (its
    root's bind at `root`, and its bind sources)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path("/run/k3sys") / hashlib.sha256(str(state_dir).encode()).hexdigest()[:12]
        self.empty = self.dir / "empty"
        self._mu = threading.Lock()

    def root(self, sid: str) -> Path:
        """Where the sandbox's root is bound (runc's `root.path`)."""
        return self.dir / sid / "root"

    def make(self, sid: str, owner: int) -> Path:
        """Make the sandbox's directory `<dir>/<sid>` (returned; 0700, owned by host uid and gid
        `owner`) and the empty `root` in it: runc checks it exists before it binds it."""
        home = self.dir / sid
        with self._mu:
            for d in (self.dir.parent, self.dir, self.empty):
                d.mkdir(exist_ok=True)
                d.chmod(0o555 if d == self.empty else 0o711)  # after mkdir: the umask is not ours
            home.mkdir(mode=0o700, exist_ok=True)
            os.chmod(home, 0o700)  # before the chown: never open to others while it is the sandbox's
            os.chown(home, owner, owner)
            (home / "root").mkdir(mode=0o700, exist_ok=True)
        return home

    def add(self, sid: str, rootfs: Path) -> Path:
        """Bind `rootfs` at `root(sid)` (returned; `make` first). The bind keeps the overlay's
        nosuid and nodev."""
        target = self.root(sid)
        layers.bind(rootfs, target)
        return target

    def drop(self, sid: str) -> None:
        """Unmount the sandbox's root and remove its directory with the files the set-up put beside
        it; the last sandbox takes the directory (under the lock `make` holds, so `empty` stays while
        a sandbox is being prepared: it is its bind source)."""
        home = self.dir / sid
        layers.unmount(home / "root")
        with self._mu, contextlib.suppress(FileNotFoundError):
            for p in home.iterdir():
                if p.name != "root":
                    p.unlink()
            (home / "root").rmdir()
            home.rmdir()
            if os.listdir(self.dir) == ["empty"]:
                self.empty.rmdir()
                self.dir.rmdir()
