"""What runc opens from inside a sandbox's user namespace (the sandbox's root, the sources of its
binds) must be reachable by an unprivileged host uid. The runtime directory's parents may be private
(~root, a 0700 temporary directory), so each sandbox's root is bound under a world-searchable
directory of the runtime, `/run/k3sys/<hash of the state dir>` (0711), made while a sandbox is being
prepared and removed with the last one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

from k3sys.sandbox.runtime import layers


class Reachable:
    """`/run/k3sys/<hash>`: `empty/` (bind source of masked directories) and `<sandbox id>` (its root)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path("/run/k3sys") / hashlib.sha256(str(state_dir).encode()).hexdigest()[:12]
        self.empty = self.dir / "empty"
        self._mu = threading.Lock()

    def make(self, sid: str) -> Path:
        """Make the (empty) directory `<dir>/<sid>` (returned): runc checks it exists before it binds it."""
        with self._mu:
            for d in (self.dir.parent, self.dir, self.empty, self.dir / sid):
                d.mkdir(exist_ok=True)
                d.chmod(0o555 if d == self.empty else 0o711)  # after mkdir: the umask is not ours
        return self.dir / sid

    def add(self, sid: str, rootfs: Path) -> Path:
        """Bind `rootfs` at `<dir>/<sid>` (returned), making the directory if needed."""
        target = self.make(sid)
        layers.bind(rootfs, target)
        return target

    def drop(self, sid: str) -> None:
        """Unmount and remove `<dir>/<sid>`; the last sandbox takes the directory (under the lock
        `add` holds, so `empty` stays while a sandbox is being prepared: it is its bind source)."""
        layers.unmount(self.dir / sid)
        with self._mu, contextlib.suppress(FileNotFoundError):
            (self.dir / sid).rmdir()
            if os.listdir(self.dir) == ["empty"]:
                self.empty.rmdir()
                self.dir.rmdir()
