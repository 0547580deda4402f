"""The sandbox table every part of `Runtime` works on: records by id, a lock per sandbox, the
directories of each, and the state transitions (`_set` persists each one before it returns).

`_mu` guards the dictionaries; a sandbox's own lock (`_locked`) is held for the whole length of a
life-cycle operation, so two operations on one sandbox never interleave (runtime.py's docstring).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from k3sys.sandbox.errors import (
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
)
from k3sys.sandbox.runtime.drivers.base import Driver, SandboxDirs
from k3sys.sandbox.runtime.state import Record, State
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.templates import template_rootfs
from k3sys.sandbox.spec import check_id
from k3sys.sandbox.types import SandboxInfo


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Table:
    """Records, locks and directories of one runtime directory's sandboxes (see the module docstring).
    The attributes are set by `Runtime.__init__`."""

    root: Path
    driver: Driver
    store: Store
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
        rec.state = state
        for k, v in changes.items():
            setattr(rec, k, v)
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

    @staticmethod
    def _require(rec: Record, op: str, *allowed: State) -> None:
        if rec.state not in allowed:
            want = " or ".join(s.value for s in allowed)
            raise InvalidStateError(f"cannot {op} sandbox {rec.id}: it is {rec.state.value} (needs {want})")

    def _layer_dir(self, ck: str | None) -> Path | None:
        return self.root / "layers" / ck if ck else None

    def _lowers(self, rec: Record) -> list[Path]:
        template = template_rootfs(rec.spec.template)
        layer = self._layer_dir(rec.layer)
        return [layer, template] if layer else [template]

    def _register(self, rec: Record) -> None:
        with self._mu:
            self._records[rec.id] = rec
            self._locks.setdefault(rec.id, threading.RLock())

    def _staging(self, name: str) -> tuple[Path, Path]:
        """(tmpfs directory for process images, disk directory for a sealed tree), both not yet created.

        Unique per call: staging is deleted off the caller's path, so a retried operation must not meet
        (or have deleted under it) the directory of an earlier attempt."""
        self.scratch.mkdir(mode=0o700, exist_ok=True)
        name = f"{name}-{secrets.token_hex(4)}"
        return self.scratch / name, self.root / "tmp" / name

    def _claim_id(self, id: str | None) -> str:
        sid = check_id("id", id) if id is not None else _new_id("sbx")
        with self._mu:
            if sid in self._records or self._dirs(sid).root.exists():
                raise InvalidArgumentError(f"id: sandbox {sid!r} already exists")
            self._dirs(sid).root.mkdir(parents=True)
        return sid

    @staticmethod
    def _info(rec: Record) -> SandboxInfo:
        return SandboxInfo(rec.id, rec.state.value, rec.spec, rec.created, rec.head, rec.reason)
