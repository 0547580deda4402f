"""The sandbox table every part of `Runtime` works on: records by id, a lock per sandbox, the
directories of each, and the state transitions (`_set` persists each one before it returns).

`_mu` guards the dictionaries; a sandbox's own lock (`_locked`) is held for the whole length of a
life-cycle operation, so two operations on one sandbox never interleave (runtime.py's docstring).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from k3sys.sandbox.errors import (
    AgentError,
    AgentInterruptedError,
    DriverError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
)
from k3sys.sandbox.runtime.agent import Agent
from k3sys.sandbox.runtime.drivers.base import Driver, SandboxDirs
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.state import Record, State
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.templates import template_rootfs, template_user
from k3sys.sandbox.runtime.trees import new_id
from k3sys.sandbox.spec import check_id
from k3sys.sandbox.types import SandboxInfo

T = TypeVar("T")
_log = logging.getLogger(__name__)


class Table:
    """Records, locks and directories of one runtime directory's sandboxes (see the module docstring).
    The attributes are set by `Runtime.__init__`."""

    root: Path
    driver: Driver
    store: Store
    layers: LayerSet
    scratch: Path
    on_timeout: str
    _mu: threading.Lock
    _records: dict[str, Record]
    _locks: dict[str, threading.RLock]
    _timings: dict[str, dict[str, float]]
    _cleaner: ThreadPoolExecutor

    def _dirs(self, sid: str) -> SandboxDirs:
        return SandboxDirs(self.root / "sandboxes" / sid)

    def _save(self, rec: Record) -> None:
        rec.save(self._dirs(rec.id).root / "record.json")

    def _set(self, rec: Record, state: State, **changes: Any) -> None:
        """Change `rec` and persist it; the layers it holds follow (acquired before released)."""
        held = rec.held_layers()
        rec.state = state
        for k, v in changes.items():
            setattr(rec, k, v)
        self.layers.update(held, rec.held_layers())
        self._save(rec)

    @contextlib.contextmanager
    def _locked(self, sid: str) -> Iterator[Record]:
        """The sandbox's record, with its lock held (NotFoundError for an unknown or killed id)."""
        with self._mu:
            lock = self._locks.get(sid)
        if lock is None:
            raise NotFoundError(f"no sandbox {sid!r}")
        with lock:
            with self._mu:
                rec = self._records.get(sid)
                # Killed while we waited (and perhaps its id reused, under a new lock).
                if rec is None or self._locks.get(sid) is not lock:
                    raise NotFoundError(f"no sandbox {sid!r}")
            yield rec

    def _agent(self, sid: str) -> Agent:
        with self._mu:
            rec = self._records.get(sid)
            if rec is None:  # killed: its agent went with it
                raise AgentError(f"sandbox agent: sandbox {sid} is gone")
        agent = self.driver.agent(sid, self._dirs(sid))
        agent.user = template_user(rec.spec.template)  # calls naming no user run as the template's
        return agent

    def _retrying(self, sid: str, call: Callable[[Agent], T], deadline: float | None = None) -> T:
        """`call(agent)` on the sandbox's agent, made again when a checkpoint cut it (the agent's gate
        holds the retry until the sandbox runs again)."""
        while True:
            try:
                return call(self._agent(sid))
            except AgentInterruptedError:
                if deadline is not None and time.monotonic() > deadline:
                    raise

    @staticmethod
    def _require(rec: Record, op: str, *allowed: State) -> None:
        if rec.state not in allowed:
            want = " or ".join(s.value for s in allowed)
            raise InvalidStateError(f"cannot {op} sandbox {rec.id}: it is {rec.state.value} (needs {want})")

    def _layer_dir(self, ck: str | None) -> Path | None:
        return self.layers.path(ck) if ck else None

    def _lowers(self, rec: Record) -> list[Path]:
        template = template_rootfs(rec.spec.template)
        layer = self._layer_dir(rec.layer)
        return [layer, template] if layer else [template]

    def _register(self, rec: Record) -> None:
        """Add `rec` to the table; it holds its layers from here on (until `_drop_record`)."""
        self.layers.update((), rec.held_layers())
        with self._mu:
            self._records[rec.id] = rec
            self._locks.setdefault(rec.id, threading.RLock())

    def _drop_record(self, rec: Record) -> None:
        """Drop a killed `rec` from the table and let go of its layers (the last holder deletes one)."""
        with self._mu:
            self._records.pop(rec.id, None)
            self._locks.pop(rec.id, None)
            self._timings.pop(rec.id, None)
        held = rec.held_layers()
        rec.state = State.KILLED
        self.layers.update(held, ())

    def _staging(self, name: str) -> tuple[Path, Path]:
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

    def _claim_id(self, id: str | None) -> str:
        sid = check_id("id", id) if id is not None else new_id("sbx")
        with self._mu:
            if sid in self._records or self._dirs(sid).root.exists():
                raise InvalidArgumentError(f"id: sandbox {sid!r} already exists")
            self._dirs(sid).root.mkdir(parents=True)
        return sid

    @staticmethod
    def _info(rec: Record) -> SandboxInfo:
        return SandboxInfo(rec.id, rec.state.value, rec.spec, rec.created, rec.head, rec.reason, rec.deadline,
                           rec.then_hibernate)
