"""`Fleet`'s operations that move state between nodes, always through the content-addressed store: a
node that needs a checkpoint pulls the manifest and only the chunks it lacks from a node holding it
(node.py `pull`), so a second checkpoint of the same family moves little.

    copy_checkpoint(ck, node)   make `node`'s store hold `ck`
    replicate(ck)               ... on one more node (placement picks it): survives a node loss
    hibernate(sid)              on its node, then replicated (`FleetConfig.replicate_hibernated`)
    resume(sid)                 where it is if that node has room; else, or if its node is lost,
                                on another node from a copy of its checkpoint (same id)
    migrate(sid, node)          hibernate (if live) on A, restore on B with the same id, forget it on A
    restore(ck, id, node)       on the node placement picks, pulling `ck` there first
    fork(sid, n, nodes)         on the source's node when it has room (no store: fastest); otherwise, or
                                where `nodes` says, children elsewhere are restored from a checkpoint

Every move leaves the source as it was when it fails: a failed copy changes nothing on the source, and
a failed restore puts a migrating sandbox back on its source, hibernated (see `_move`).

`Moves` is built on the fleet's `Sandboxes` (placement, records, checkpoints) and its `Members`; it
keeps the record of recent transfers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from k3sys.fleet.config import FleetConfig
from k3sys.fleet.members import Members
from k3sys.fleet.sandboxes import Sandboxes
from k3sys.sandbox.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandboxError,
    UnavailableError,
)
from k3sys.sandbox.spec import MAX_FORK, SandboxSpec, check_number
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One checkpoint copied to a node: `bytes` of chunk data moved (what the target lacked), `seconds`."""

    ck: str
    source: str
    target: str
    bytes: int
    seconds: float


class Moves:
    """See the module docstring."""

    def __init__(self, config: FleetConfig, members: Members, sandboxes: Sandboxes) -> None:
        self.config, self.members, self.sandboxes = config, members, sandboxes
        self.records, self.placer = sandboxes.records, sandboxes.placer
        self.transfers: deque[Transfer] = deque(maxlen=1000)  # the latest copies, oldest first

    def copy_checkpoint(self, ck: str, node: str) -> Transfer:
        """Make node `node`'s store hold checkpoint `ck`, pulling only the chunks it lacks from a holder."""
        src = self.sandboxes.holder(ck, prefer=node)
        if src == node:
            return Transfer(ck, node, node, 0, 0.0)
        moved, seconds = self.members.invoke(node, "pull", ck, self.members.get(src).handle)
        self.records.held(ck, node)
        t = Transfer(ck, src, node, moved, seconds)
        self.transfers.append(t)
        return t

    def replicate(self, ck: str, node: str | None = None) -> Transfer:
        """Copy checkpoint `ck` to `node`, or to a node not holding it yet (placement picks)."""
        if node is None:
            node = self.placer.free(exclude=tuple(self.records.holders(ck)))
        return self.copy_checkpoint(ck, node)

    def hibernate(self, sid: str) -> CheckpointInfo:
        node = self.records.node_of(sid)
        ck = self.members.call(node, "hibernate", sid)
        self.records.held(ck.id, node)
        self.records.seen(sid, state="hibernated", head=ck.id)
        if self.config.replicate_hibernated:
            # Best effort: with no second node (or no room there) the sandbox is hibernated all the same.
            with contextlib.suppress(CapacityError, UnavailableError):
                self.replicate(ck.id)
        return ck

    def resume(self, sid: str) -> None:
        """Thaw or restore the sandbox; a hibernated one comes back on another node (same id) when its
        own has no room or is lost."""
        rec = self.records.get(sid)
        if rec is None:
            raise NotFoundError(f"no sandbox {sid!r}")
        node = rec.node
        if node is None:  # its node is lost: `info` says whether a copy of its checkpoint lives on
            last = self.sandboxes.info(sid)
            if last.state != "hibernated":
                raise InvalidStateError(f"sandbox {sid} is {last.state} ({last.reason})")
            self._move(sid, last.spec, last.head or "", None, None)
            return
        # The state as last seen (every change through the fleet updates it) saves a call: a paused
        # sandbox just thaws. If it was hibernated behind our back (its timeout), its node resumes it.
        last = rec.last
        if last.state == "hibernated" and not self.members.get(node).view.fits(last.spec.memory_mb):
            self._move(sid, last.spec, last.head or "", node, None)
            return
        self.members.call(node, "resume", sid)
        self.records.seen(sid, state="running")

    def migrate(self, sid: str, node: str | None = None) -> SandboxInfo:
        """Move the sandbox to `node` (placement picks one other than its own if None): hibernated on its
        node if live, restored on the target with the same id and processes, then forgotten at the source."""
        src = self.records.node_of(sid)
        if node == src:
            raise InvalidArgumentError(f"node: sandbox {sid} is on {src} already")
        info = self.members.call(src, "info", sid)  # its node's word: the move needs its latest head
        if info.state in ("running", "paused"):
            ck = self.members.call(src, "hibernate", sid)
            self.records.held(ck.id, src)
            info = dataclasses.replace(info, state="hibernated", head=ck.id)
        elif info.state != "hibernated":
            raise InvalidStateError(f"cannot migrate sandbox {sid}: it is {info.state}")
        return self._move(sid, info.spec, info.head or "", src, node)

    def _move(self, sid: str, spec: SandboxSpec, ck: str, src: str | None, node: str | None) -> SandboxInfo:
        """Restore hibernated sandbox `sid` from checkpoint `ck` on `node` (or one placement picks, not
        `src`), its record on `src` dropped once the target's store holds `ck`.

        The source's record goes before the restore, not after: sandbox ids name host-wide resources
        (cgroups `k3sys-<id>`), so on a machine running two nodes (tests, a big host split in two)
        dropping it afterwards would take the new sandbox's cgroup. A failed restore puts the
        sandbox back on the source, hibernated, from the same checkpoint."""
        target = self.placer.place(spec.memory_mb, node, exclude=(src,) if src else ())
        try:
            self.copy_checkpoint(ck, target)
            if src is not None:
                self.members.call(src, "kill", sid)  # the hibernated record; its checkpoints stay in that store
            try:
                new = self.members.call(target, "restore", ck, sid, None)
            except BaseException:
                if src is not None:
                    with contextlib.suppress(SandboxError):
                        self.members.call(src, "restore", ck, sid, None)
                        self.members.call(src, "hibernate", sid)
                raise
        except BaseException:
            self.members.charge(target, -spec.memory_mb)
            raise
        return self.sandboxes.placed(target, new)

    def restore(self, ck: str, id: str | None = None, timeout_s: float | None = None,
                node: str | None = None) -> SandboxInfo:
        """A new sandbox from checkpoint `ck` on `node` or the node placement picks (which pulls `ck`)."""
        with self.records.claim(id):
            # NotFoundError before any placement if no live node holds it
            memory_mb = int(self.sandboxes.manifest(ck).meta.get("spec", {}).get("memory_mb", 512))
            target = self.placer.place(memory_mb, node)
            try:
                self.copy_checkpoint(ck, target)
                return self.sandboxes.placed(target, self.members.call(target, "restore", ck, id, timeout_s))
            except BaseException:
                self.members.charge(target, -memory_mb)
                raise

    def fork(self, sid: str, n: int = 1, nodes: list[str] | None = None) -> list[SandboxInfo]:
        """`n` copies of the sandbox now; `nodes` names each child's node (see the module docstring)."""
        check_number("n", n, 1, MAX_FORK, "children", integer=True)
        src = self.records.node_of(sid)
        mb = self.sandboxes.info(sid).spec.memory_mb
        if nodes is None and self.members.get(src).view.fits(n * mb):
            nodes = [src] * n
        if nodes is not None and len(nodes) != n:
            raise InvalidArgumentError(f"nodes: expected {n} node names, got {len(nodes)}")
        place = self.placer.place
        placed = [place(mb, x) for x in nodes] if nodes is not None else [place(mb) for _ in range(n)]
        kids: list[SandboxInfo] = []
        try:
            here = placed.count(src)
            if here:
                kids += [self.sandboxes.placed(src, k) for k in self.members.call(src, "fork", sid, here)]
            away = [x for x in placed if x != src]
            if away:
                ck = self.sandboxes.checkpoint(sid).id
                for target in sorted(set(away)):
                    self.copy_checkpoint(ck, target)
                with ThreadPoolExecutor(max_workers=min(len(away), 8)) as pool:
                    futures = [(x, pool.submit(self.members.call, x, "restore", ck, None, None)) for x in away]
                    errors = []
                    for x, f in futures:
                        try:
                            kids.append(self.sandboxes.placed(x, f.result()))
                        except SandboxError as e:
                            errors.append(e)
                if errors:
                    raise errors[0]
        except BaseException:
            for k in kids:
                with contextlib.suppress(SandboxError):
                    self.sandboxes.kill(k.id)
            for x in placed:
                self.members.charge(x, -mb)
            raise
        return kids
