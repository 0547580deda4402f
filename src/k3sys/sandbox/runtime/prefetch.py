"""Images of a hibernated sandbox staged on tmpfs ahead of a likely `resume` (`prefetch`), so that
the resume restores without reading the store; dropped at the resume, a kill, or past their time to
live (the reaper, recovery.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.staging import Staging
from k3sys.sandbox.runtime.state import State
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.spec import check_number


@dataclass(frozen=True)
class Staged:
    """Images of checkpoint `ck` checked out to `path` by `prefetch`, kept until `expires` (monotonic s)."""

    ck: str
    path: Path
    expires: float


class Prefetcher:
    """The staged images of the sandboxes in `table` (see the module docstring)."""

    def __init__(self, table: SandboxTable, layer_set: LayerSet, store: Store, staging: Staging) -> None:
        self.table = table
        self.layers = layer_set
        self.store = store
        self.staging = staging
        self._mu = threading.Lock()  # guards `_staged`
        self._staged: dict[str, Staged] = {}  # sandbox id -> images prefetched for its resume

    def prefetch(self, sid: str, ttl_s: float = 60.0) -> bool:
        """Stage a hibernated sandbox's images on tmpfs ahead of a likely `resume` (e.g. while the
        policy model thinks), so that the resume restores without reading the store. A hint: it
        returns whether images are staged (False, doing nothing, unless the sandbox is hibernated).
        The staged copy holds as much memory as the sandbox's memory image until `resume` uses it,
        the sandbox is killed, or `ttl_s` seconds pass (a later call renews it)."""
        check_number("ttl_s", ttl_s, 0.1, 3600, "s")
        with self.table.locked(sid) as rec:
            if rec.state is not State.HIBERNATED:
                return False
            expires = time.monotonic() + ttl_s
            with self._mu:
                staged = self._staged.get(sid)
                if staged is not None and staged.ck == rec.head:
                    self._staged[sid] = Staged(staged.ck, staged.path, expires)
                    return True
            self.unstage(sid)
            self.layers.ensure(rec.head)
            path, _ = self.staging.new(f"{rec.head}-{sid}-prefetched")
            self.store.checkout(rec.head, {"images": path})
            with self._mu:
                self._staged[sid] = Staged(rec.head, path, expires)
            return True

    def staged(self, sid: str) -> Staged | None:
        """What is staged for `sid` now (None: nothing)."""
        with self._mu:
            return self._staged.get(sid)

    def unstage(self, sid: str, keep: bool = False) -> Staged | None:
        """Forget the images staged for `sid`; delete them unless `keep` (then the caller owns them)."""
        with self._mu:
            staged = self._staged.pop(sid, None)
        if staged is not None and not keep:
            self.staging.discard(staged.path)
        return staged

    def drop_expired(self) -> None:
        """Drop the staged images past their time to live."""
        mono = time.monotonic()
        with self._mu:
            stale = [sid for sid, st in self._staged.items() if st.expires <= mono]
        for sid in stale:
            self.unstage(sid)

    def close(self) -> None:
        """Drop every staged image (their sandboxes' next runtime stages again when asked)."""
        with self._mu:
            sids = list(self._staged)
        for sid in sids:
            self.unstage(sid)
