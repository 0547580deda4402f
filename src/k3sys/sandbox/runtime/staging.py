"""Staging: the directories an operation writes a sandbox's images and sealed file system into
before they go to the store, a layer or a restore, and the thread that deletes them off the caller's
path (freeing 64 MiB of tmpfs takes ~5 ms)."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime.trees import remove_tree


class Staging:
    """Process images on tmpfs under `scratch`, sealed trees on disk under `<root>/tmp`."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root = root
        self.scratch = scratch
        self._cleaner = ThreadPoolExecutor(1, thread_name_prefix="k3sys-sandbox-cleanup")

    def new(self, name: str) -> tuple[Path, Path]:
        """(tmpfs directory for process images, disk directory for a sealed tree), both not yet created.

        Unique per call: staging is deleted off the caller's path, so a retried operation must not meet
        (or have deleted under it) the directory of an earlier attempt."""
        self.scratch.mkdir(mode=0o700, exist_ok=True)
        # Its name is predictable and /dev/shm open to every host user, who could make it first and
        # then read or change tenants' process images (which CRIU, as root, restores): only ours.
        st = os.lstat(self.scratch)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise DriverError(f"{self.scratch}: not this runtime's private directory (owner {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):o}): another host user made it? Remove it")
        name = f"{name}-{secrets.token_hex(4)}"
        return self.scratch / name, self.root / "tmp" / name

    def discard(self, path: Path) -> None:
        """Delete `path` off the caller's path."""
        self._cleaner.submit(remove_tree, path)

    def later(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on the deleting thread (clean-up that must wait for something first)."""
        self._cleaner.submit(fn, *args)

    def wipe(self) -> None:
        """Delete every staging directory (a runtime starting: what a crashed one left)."""
        for d in (self.root / "tmp").iterdir():
            remove_tree(d)
        remove_tree(self.scratch)

    def close(self) -> None:
        """Finish the deletions queued and remove the (then empty) tmpfs directory."""
        self._cleaner.shutdown(wait=True)
        with contextlib.suppress(OSError):
            self.scratch.rmdir()
