"""Startup recovery and the reaper.

Recovery: a runtime opening a directory another runtime left (crashed) adopts its sandboxes:
orphan runc/CRIU helpers are killed, a sandbox caught mid-checkpoint is thawed and rolled back,
one whose processes died is reported `lost` (never dropped), and staging directories are wiped.
A sandbox paused for a background hibernation (`then_hibernate`) that had not finished stays frozen
and its hibernation is queued again: E2B's pause promised its memory back.

The reaper (a thread, every 0.5 s) drops prefetched images past their time to live and applies
each expired sandbox's `on_timeout` (kill, or hibernate).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

from k3sys.sandbox.errors import SandboxError
from k3sys.sandbox.runtime.background import Hibernator
from k3sys.sandbox.runtime.catalog import INTERNAL, Catalog
from k3sys.sandbox.runtime.checkpoints import CheckpointService
from k3sys.sandbox.runtime.drivers.base import Driver
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.prefetch import Prefetcher
from k3sys.sandbox.runtime.reclaim import Reclaimer
from k3sys.sandbox.runtime.staging import Staging
from k3sys.sandbox.runtime.state import LIVE, Record, State
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.trees import remove_tree

_log = logging.getLogger(__name__)


class Recovery:
    """Startup recovery (`recover`) and the reaper (`start`, `close`) of the runtime directory `root`
    (see the module docstring); `on_timeout` is the runtime's default."""

    def __init__(self, root: Path, table: SandboxTable, layer_set: LayerSet, store: Store, driver: Driver,
                 staging: Staging, prefetcher: Prefetcher, catalog: Catalog, reclaimer: Reclaimer,
                 checkpoints: CheckpointService, hibernator: Hibernator, on_timeout: str) -> None:
        self.root = root
        self.table = table
        self.layers = layer_set
        self.store = store
        self.driver = driver
        self.staging = staging
        self.prefetcher = prefetcher
        self.catalog = catalog
        self.reclaimer = reclaimer
        self.checkpoints = checkpoints
        self.hibernator = hibernator
        self.on_timeout = on_timeout
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap_expired, name="k3sys-sandbox-reaper", daemon=True)

    def recover(self) -> None:
        """Adopt the sandboxes a runtime before left in the directory (see the module docstring)."""
        self.driver.cleanup_stale()
        self.store.gc()  # temp files and unreferenced packs of commits a crash interrupted
        self.staging.wipe()
        for path in sorted((self.root / "sandboxes").glob("*/record.json")):
            rec = Record.load(path)
            self.table.register(rec)
            self._settle(rec)
            if rec.state is State.PAUSED and rec.then_hibernate:
                self.hibernator.submit(rec.id)
        for d in (self.root / "sandboxes").iterdir():  # created but never recorded
            if not (d / "record.json").exists():
                with contextlib.suppress(SandboxError):
                    self.driver.destroy(d.name, self.table.dirs(d.name))
                remove_tree(d)
        self.layers.sweep()  # the counts are the records' now: what no record holds, a crash left

    def _settle(self, rec: Record) -> None:
        """Bring one adopted record in line with what is really there (see the module docstring)."""
        status = self.driver.status(rec.id)
        alive = status in ("running", "paused")
        committed = rec.pending if rec.pending and self.catalog.has(rec.pending) else None
        s = rec.state
        if s is State.HIBERNATING and committed:
            # The checkpoint is durable: finish the hibernation.
            with contextlib.suppress(SandboxError):
                self.driver.destroy(rec.id, self.table.dirs(rec.id))
            self.reclaimer.wipe_upper(rec)
            superseded, own = rec.hibernation, self.store.get(committed).meta.get(INTERNAL)
            self.table.set(rec, State.HIBERNATED, head=committed, layer=None,
                           sealed_bytes=self.catalog.fs_bytes(committed), prev=None, pending=None,
                           then_hibernate=False, hibernation=committed if own else None)
            self.catalog.drop_own(superseded)
        elif s in (State.CHECKPOINTING, State.HIBERNATING, *LIVE) and alive:
            target = rec.prev if s in (State.CHECKPOINTING, State.HIBERNATING) else s
            if target is State.RUNNING and status == "paused":
                self.driver.resume(rec.id)
            elif target is State.PAUSED and status == "running":
                self.driver.pause(rec.id)
            self.table.set(rec, target, head=committed or rec.head, prev=None, pending=None)
        elif s is State.RESUMING and alive:
            self.table.set(rec, State.RUNNING, layer=rec.head, prev=None)
        elif s is State.RESUMING:
            with contextlib.suppress(SandboxError):
                self.driver.destroy(rec.id, self.table.dirs(rec.id))
            self.reclaimer.wipe_upper(rec)
            self.table.set(rec, State.HIBERNATED, prev=None)
        elif s in (State.HIBERNATED, State.LOST):
            pass
        else:  # creating, or its processes are gone
            with contextlib.suppress(SandboxError):
                self.driver.destroy(rec.id, self.table.dirs(rec.id))
            why = ("the runtime died while creating it" if s is State.CREATING
                   else f"its processes were gone when the runtime restarted (it was {s.value})")
            _log.warning("sandbox %s lost: %s", rec.id, why)
            self.table.set(rec, State.LOST, reason=why, prev=None, pending=None, then_hibernate=False)

    def _reap_expired(self) -> None:
        while not self._closed.wait(0.5):
            self.prefetcher.drop_expired()
            now = time.time()
            expired = [r.id for r in self.table.records() if r.deadline is not None and r.deadline <= now]
            for sid in expired:
                try:
                    self.expire(sid)
                except Exception as e:  # noqa: BLE001 - the reaper must outlive any one sandbox's failure
                    _log.warning("timeout of sandbox %s not applied: %s: %s", sid, type(e).__name__, e)

    def expire(self, sid: str) -> None:
        """Apply the sandbox's `on_timeout` (its spec's, else the runtime's) if it is still past its deadline."""
        with self.table.locked(sid) as rec:
            if rec.deadline is None or rec.deadline > time.time():
                return  # renewed or handled while we waited for the lock
            if (rec.spec.on_timeout or self.on_timeout) == "kill":
                _log.info("sandbox %s: timeout_s=%g ran out: killed", sid, rec.spec.timeout_s)
                self.reclaimer.discard(rec)
                return
            if rec.state not in LIVE:  # hibernated or lost already: nothing runs to stop
                self.table.set(rec, rec.state, deadline=None)
                return
            try:
                self.hibernator.take(sid)  # a queued background hibernation of it is this one now
                self.checkpoints.hibernate(sid, internal=True)  # E2B's auto-pause: the sandbox's own
            except Exception as e:  # noqa: BLE001 - e.g. a full disk under the store, a stuck agent
                # Its time is up either way: never hold resources past it; but never silently.
                _log.warning("sandbox %s: timeout_s=%g ran out and its hibernation failed (%s: %s): killed",
                             sid, rec.spec.timeout_s, type(e).__name__, e)
                self.reclaimer.discard(rec)
                return
            why = f"hibernated when its timeout_s={rec.spec.timeout_s:g} ran out"
            _log.info("sandbox %s: %s", sid, why)
            self.table.set(rec, rec.state, deadline=None, reason=why)

    def start(self) -> None:
        """Start the reaper."""
        self._reaper.start()

    def close(self) -> None:
        """Stop the reaper (after the round in progress)."""
        self._closed.set()
        if self._reaper.is_alive():
            self._reaper.join()
