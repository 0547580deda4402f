"""The sandbox table: records by id, a lock per sandbox, the directory of each, and its state
changes, checked against the one transition table (`state.TRANSITIONS`) and persisted before they
return.

A sandbox's own lock (`locked`) is held for the whole length of a life-cycle operation, so two
operations on one sandbox never interleave (runtime.py's docstring); the table's lock guards only its
dictionaries. `transition` is the shape of most operations: check the state, set the transitional
one, do the work, set the final one, or on an exception set the state before again. Each record
holds its sealed layers (`Record.held_layers`) in the `LayerSet` for as long as it is in the table.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from k3sys.sandbox.errors import InvalidArgumentError, InvalidStateError, NotFoundError
from k3sys.sandbox.runtime.drivers.base import SandboxDirs
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.state import TRANSITIONS, Record, State
from k3sys.sandbox.runtime.trees import new_id
from k3sys.sandbox.spec import check_id
from k3sys.sandbox.types import SandboxInfo


class SandboxTable:
    """The sandboxes of the runtime directory `root` (see the module docstring)."""

    def __init__(self, root: Path, layers: LayerSet) -> None:
        self.root = root
        self.layers = layers
        self._mu = threading.Lock()  # guards the dictionaries below
        self._records: dict[str, Record] = {}
        self._locks: dict[str, threading.RLock] = {}
        self.timings: dict[str, dict[str, float]] = {}  # sandbox id -> seconds per phase of its latest operation

    def dirs(self, sid: str) -> SandboxDirs:
        return SandboxDirs(self.root / "sandboxes" / sid)

    def save(self, rec: Record) -> None:
        rec.save(self.dirs(rec.id).root / "record.json")

    def set(self, rec: Record, state: State, **changes: Any) -> None:
        """Change `rec` (its lock held) and persist it; the layers it holds follow (acquired before
        released). A state change the transition table does not allow is a bug: RuntimeError."""
        if state is not rec.state and state not in TRANSITIONS[rec.state]:
            raise RuntimeError(f"sandbox {rec.id}: no transition {rec.state.value} -> {state.value}")
        held = rec.held_layers()
        rec.state = state
        for k, v in changes.items():
            setattr(rec, k, v)
        self.layers.update(held, rec.held_layers())
        self.save(rec)

    @contextlib.contextmanager
    def locked(self, sid: str) -> Iterator[Record]:
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

    @contextlib.contextmanager
    def transition(self, sid: str, allowed_from: tuple[State, ...], via: State, to: State | None,
                   op: str) -> Iterator[Record]:
        """`op` on the sandbox: with its lock held, InvalidStateError unless it is in `allowed_from`;
        the record says `via` (with `prev` the state before) while the block runs; then `to` (None: the
        state before), or on an exception the state before again, nothing `pending`. The block may
        `set` other fields (with the state it is in); those it sets before raising stay."""
        with self.locked(sid) as rec:
            self.require(rec, op, *allowed_from)
            before = rec.state
            self.set(rec, via, prev=before)
            try:
                yield rec
            except BaseException:
                self.set(rec, before, prev=None, pending=None)
                raise
            self.set(rec, to or before, prev=None)

    def get(self, sid: str) -> Record | None:
        """The record of `sid` (no lock held: read, do not change it), or None."""
        with self._mu:
            return self._records.get(sid)

    def records(self) -> list[Record]:
        """Every record, oldest first (no lock held: read, do not change them)."""
        with self._mu:
            return sorted(self._records.values(), key=lambda r: (r.created, r.id))

    def register(self, rec: Record) -> None:
        """Add `rec` to the table; it holds its layers from here on (until `drop`)."""
        self.layers.update((), rec.held_layers())
        with self._mu:
            self._records[rec.id] = rec
            self._locks.setdefault(rec.id, threading.RLock())

    def drop(self, rec: Record) -> None:
        """Drop a killed `rec` (its lock held) and let go of its layers (the last holder deletes one)."""
        with self._mu:
            self._records.pop(rec.id, None)
            self._locks.pop(rec.id, None)
            self.timings.pop(rec.id, None)
        held = rec.held_layers()
        rec.state = State.KILLED
        self.layers.update(held, ())

    def claim_id(self, id: str | None) -> str:
        """`id` (checked), or a new one, with its directory made; InvalidArgumentError if taken."""
        sid = check_id("id", id) if id is not None else new_id("sbx")
        with self._mu:
            if sid in self._records or self.dirs(sid).root.exists():
                raise InvalidArgumentError(f"id: sandbox {sid!r} already exists")
            self.dirs(sid).root.mkdir(parents=True)
        return sid

    @staticmethod
    def require(rec: Record, op: str, *allowed: State) -> None:
        if rec.state not in allowed:
            want = " or ".join(s.value for s in allowed)
            raise InvalidStateError(f"cannot {op} sandbox {rec.id}: it is {rec.state.value} (needs {want})")

    @staticmethod
    def info(rec: Record) -> SandboxInfo:
        return SandboxInfo(rec.id, rec.state.value, rec.spec, rec.created, rec.head, rec.reason, rec.deadline,
                           rec.then_hibernate)
