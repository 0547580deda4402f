"""`Sandboxes`: the fleet's sandbox and checkpoint calls that need more than routing by id: create
(placed), info (cached for `FleetConfig.info_ttl_s`), list (every node), kill, pause, checkpoint, and
the checkpoints of every node. Moves between nodes build on it (moves.py)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import ray

from k3sys.fleet.config import FleetConfig
from k3sys.fleet.members import Members, NodeDiedError, unwrap
from k3sys.fleet.placement import Placer
from k3sys.fleet.records import Records
from k3sys.sandbox.errors import CheckpointNotFoundError, NotFoundError, SandboxError
from k3sys.sandbox.runtime.store import Manifest
from k3sys.sandbox.spec import SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo


class Sandboxes:
    """Sandboxes and checkpoints over `members`' nodes, recorded in `records`, placed by `placer`."""

    def __init__(self, config: FleetConfig, members: Members, records: Records, placer: Placer) -> None:
        self.config, self.members, self.records, self.placer = config, members, records, placer

    def placed(self, node: str, info: SandboxInfo) -> SandboxInfo:
        """Record a sandbox a placement put on `node`, its create done (`Members.settle`)."""
        self.members.settle(node, info.id, info.spec.memory_mb)
        return self.records.note(node, info)

    def create(self, spec: SandboxSpec, id: str | None = None, node: str | None = None) -> SandboxInfo:
        """A new sandbox on the node placement picks (or `node`)."""
        with self.records.claim(id):
            name = self.placer.place(spec.memory_mb, node)
            try:
                return self.placed(name, self.members.call(name, "create", spec, id))
            except BaseException:
                self.members.charge(name, -spec.memory_mb)
                raise

    def info(self, sid: str) -> SandboxInfo:
        rec = self.records.get(sid)
        if rec is None:
            raise NotFoundError(f"no sandbox {sid!r}")
        if rec.node is None:
            return rec.last  # on a lost node: what we knew, marked lost (or hibernated, resumable elsewhere)
        if time.monotonic() - rec.seen < self.config.info_ttl_s:
            return rec.last
        try:
            return self.records.note(rec.node, self.members.call(rec.node, "info", sid))
        except NodeDiedError:
            return self.records.get(sid).last  # type: ignore[union-attr]  # marked lost (or resumable) by now
        except NotFoundError:
            self.records.forget(sid)  # killed on its node behind our back (its timeout)
            raise

    def gather(self, method: str) -> dict[str, Any]:
        """`Runtime.<method>()`'s answer from every live node that gives one, by node name."""
        refs = {m.name: m.handle.call.remote(method) for m in self.members.live()}
        out = {}
        for name, ref in refs.items():
            with contextlib.suppress(SandboxError):  # a node failing now: the monitor decides whether it is lost
                out[name] = unwrap(lambda ref=ref: ray.get(ref), name)
        return out

    def list(self) -> list[SandboxInfo]:
        """Every sandbox of every live node, and those of lost nodes (state "lost" or "hibernated")."""
        seen: dict[str, SandboxInfo] = {}
        for name, infos in self.gather("list").items():
            for i in infos:
                seen[i.id] = self.records.note(name, i)
        # Not forgotten when missing from their node's answer: a create may have finished after the
        # node answered. A sandbox gone behind our back is forgotten by `info`.
        seen |= self.records.on_lost_nodes()
        return sorted(seen.values(), key=lambda i: (i.created, i.id))

    def kill(self, sid: str) -> None:
        """Kill the sandbox; one on a lost node is only forgotten (its machine took it)."""
        rec = self.records.get(sid)
        if rec is None:
            raise NotFoundError(f"no sandbox {sid!r}")
        if rec.node is not None:
            self.members.call(rec.node, "kill", sid)
            if rec.last.state not in ("hibernated", "lost"):  # its memory is free at once
                self.members.release(rec.node, sid, rec.last.spec.memory_mb)
        self.records.forget(sid)

    def pause(self, sid: str) -> None:
        """Freeze the sandbox on its node."""
        self.members.call(self.records.node_of(sid), "pause", sid)
        self.records.seen(sid, state="paused")

    def checkpoint(self, sid: str) -> CheckpointInfo:
        node = self.records.node_of(sid)
        ck = self.members.call(node, "checkpoint", sid)
        self.records.held(ck.id, node)
        return ck

    # --- checkpoints --------------------------------------------------------------------------------

    def holder(self, ck: str, prefer: str | None = None) -> str:
        """A live node whose store holds checkpoint `ck` (`prefer` if it does)."""
        holders = self.records.holders(ck)
        if not holders:
            self.checkpoints()  # a checkpoint made behind the gateway's back
            holders = self.records.holders(ck)
        if not holders:
            raise CheckpointNotFoundError(f"no checkpoint {ck!r} on any live node")
        return prefer if prefer in holders else holders[0]

    def manifest(self, ck: str) -> Manifest:
        """Checkpoint `ck`'s manifest, from a node holding it."""
        return self.members.invoke(self.holder(ck), "manifest", ck)

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint of every live node (one entry per id, wherever it is held)."""
        out: dict[str, CheckpointInfo] = {}
        for name, infos in self.gather("checkpoints").items():
            for c in infos:
                out.setdefault(c.id, c)
                self.records.held(c.id, name)
        return sorted(out.values(), key=lambda c: (c.created, c.id))

    def get_checkpoint(self, ck: str) -> CheckpointInfo:
        return self.members.call(self.holder(ck), "get_checkpoint", ck)

    def delete_checkpoint(self, ck: str) -> None:
        """Delete `ck` from every live node holding it (refused, as on one node, while a hibernated
        sandbox needs it)."""
        self.holder(ck)  # NotFoundError unless a live node holds it
        for node in self.records.holders(ck):
            self.members.call(node, "delete_checkpoint", ck)
            self.records.dropped(ck, node)
