"""`Records`: what the gateway knows of every sandbox (the node it lives on, its latest info and when
that was seen) and of every checkpoint (the live nodes whose store holds it), under one lock. Filled
from the nodes as they join and from every answer that passes through the fleet; no Ray here, so the
other parts' tests fake the nodes and use a real `Records`."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

from k3sys.sandbox.errors import InvalidArgumentError, InvalidStateError, NotFoundError
from k3sys.sandbox.types import SandboxInfo


@dataclasses.dataclass(frozen=True)
class Record:
    """One sandbox as last seen: its node (None: on a lost node), its info, when (monotonic s)."""

    node: str | None
    last: SandboxInfo
    seen: float


class Records:
    """See the module docstring."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._where: dict[str, str | None] = {}  # sandbox id -> node (None: on a lost node)
        self._last: dict[str, SandboxInfo] = {}  # sandbox id -> latest info seen
        self._fresh: dict[str, float] = {}  # sandbox id -> when (monotonic s) its info was last seen
        self._claimed: set[str] = set()  # ids of creates in flight
        self._holders: dict[str, set[str]] = {}  # checkpoint id -> live nodes whose store has it

    # --- sandboxes ----------------------------------------------------------------------------------

    def note(self, node: str, info: SandboxInfo) -> SandboxInfo:
        """Sandbox `info.id` lives on `node`, as `info` says now."""
        with self._mu:
            self._where[info.id] = node
            self._last[info.id] = info
            self._fresh[info.id] = time.monotonic()
        return info

    def seen(self, sid: str, **changes: Any) -> None:
        """Record a change the fleet made to sandbox `sid` (its state, head) without asking its node."""
        with self._mu:
            if sid in self._last:
                self._last[sid] = dataclasses.replace(self._last[sid], **changes)
                self._fresh[sid] = time.monotonic()

    def forget(self, sid: str) -> None:
        with self._mu:
            self._where.pop(sid, None)
            self._last.pop(sid, None)
            self._fresh.pop(sid, None)

    def get(self, sid: str) -> Record | None:
        """Sandbox `sid` as last seen; None if unknown (or known only by a create still in flight)."""
        with self._mu:
            if sid not in self._last:
                return None
            return Record(self._where[sid], self._last[sid], self._fresh[sid])

    def node_of(self, sid: str) -> str:
        """The node sandbox `sid` lives on; InvalidStateError if that node is lost."""
        with self._mu:
            if sid in self._where:
                node = self._where[sid]
                if node is not None:
                    return node
                last = self._last[sid]
                raise InvalidStateError(f"sandbox {sid} is {last.state} ({last.reason or 'its node is lost'})")
        raise NotFoundError(f"no sandbox {sid!r}")

    def on_lost_nodes(self) -> dict[str, SandboxInfo]:
        """The sandboxes of lost nodes, as last seen (state "lost", or "hibernated" and resumable)."""
        with self._mu:
            return {sid: self._last[sid] for sid, node in self._where.items() if node is None}

    @contextlib.contextmanager
    def claim(self, sid: str | None) -> Iterator[None]:
        """Hold id `sid` for a create in flight: ids are unique over the whole fleet."""
        if sid is not None:
            with self._mu:
                if sid in self._where or sid in self._claimed:
                    raise InvalidArgumentError(f"id: sandbox {sid!r} already exists")
                self._claimed.add(sid)
        try:
            yield
        finally:
            with self._mu:
                self._claimed.discard(sid or "")

    # --- checkpoints --------------------------------------------------------------------------------

    def held(self, ck: str, node: str) -> None:
        """Node `node`'s store holds checkpoint `ck`."""
        with self._mu:
            self._holders.setdefault(ck, set()).add(node)

    def dropped(self, ck: str, node: str) -> None:
        """Node `node`'s store no longer holds checkpoint `ck`."""
        with self._mu:
            self._holders.get(ck, set()).discard(node)

    def holders(self, ck: str) -> list[str]:
        """The live nodes known to hold checkpoint `ck`, by name."""
        with self._mu:
            return sorted(self._holders.get(ck, ()))

    # --- nodes --------------------------------------------------------------------------------------

    def joined(self, node: str, infos: list[SandboxInfo], cks: list[str]) -> None:
        """Node `node` joined with sandboxes `infos` and checkpoints `cks` in its store."""
        for i in infos:
            self.note(node, i)
        for ck in cks:
            self.held(ck, node)

    def lost(self, node: str, why: str) -> None:
        """Node `node` is lost: its sandboxes are marked lost, except hibernated ones whose checkpoint
        another live node holds (they resume elsewhere, same id)."""
        with self._mu:
            for holders in self._holders.values():
                holders.discard(node)
            for sid, where in list(self._where.items()):
                if where != node:
                    continue
                self._where[sid] = None
                last = self._last[sid]
                if last.state == "hibernated" and self._holders.get(last.head or ""):
                    continue  # resumable from another node's copy
                self._last[sid] = dataclasses.replace(last, state="lost", reason=f"node {node} lost: {why}")
