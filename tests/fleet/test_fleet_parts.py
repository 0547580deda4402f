"""The fleet's parts alone, over fake nodes (no Ray cluster): `Moves` and `Commands` are built with
what they use, so a fake of `Members` (the node calls, with real `Member` views and charges) and a
real `Records` are all they need. fleet.py wires the same parts over the real `Members`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from types import SimpleNamespace
from typing import Any

import pytest

from k3sys.fleet.commands import Commands
from k3sys.fleet.config import FleetConfig
from k3sys.fleet.members import Member
from k3sys.fleet.moves import Moves
from k3sys.fleet.node import NodeStats
from k3sys.fleet.placement import Placer
from k3sys.fleet.records import Records
from k3sys.fleet.sandboxes import Sandboxes
from k3sys.sandbox.errors import InvalidStateError, NotFoundError, UnavailableError
from k3sys.sandbox.runtime.agent_protocol import Exit
from k3sys.sandbox.spec import SandboxSpec
from k3sys.sandbox.types import SandboxInfo

MB = 512


class FakeNode:
    """One node's runtime and store, in memory: its sandboxes and checkpoints; `fail` names methods
    that raise UnavailableError."""

    def __init__(self, name: str) -> None:
        self.name, self.sandboxes, self.cks, self.fail = name, {}, set(), set()
        self._ids = itertools.count()

    def _check(self, method: str) -> None:
        if method in self.fail:
            raise UnavailableError(f"{self.name}: {method} failed (as told)")

    def restore(self, ck: str, sid: str | None, timeout_s: float | None) -> SandboxInfo:
        self._check("restore")
        assert ck in self.cks, f"{self.name} restores {ck} without holding it"
        sid = sid or f"{self.name}-{next(self._ids)}"
        info = SandboxInfo(sid, "running", SandboxSpec(memory_mb=MB), time.time(), ck)
        self.sandboxes[info.id] = info
        return info

    def hibernate(self, sid: str) -> SimpleNamespace:
        ck = f"ck-{self.name}-{next(self._ids)}"
        self.cks.add(ck)
        self.sandboxes[sid] = dataclasses.replace(self.sandboxes[sid], state="hibernated", head=ck)
        return SimpleNamespace(id=ck)

    def info(self, sid: str) -> SandboxInfo:
        if sid not in self.sandboxes:
            raise NotFoundError(f"no sandbox {sid!r}")
        return self.sandboxes[sid]

    def kill(self, sid: str) -> None:
        del self.sandboxes[sid]

    def pull(self, ck: str, source: FakeNode) -> tuple[int, float]:
        assert ck in source.cks
        self.cks.add(ck)
        return 4096, 0.001


class FakeMembers:
    """What the parts use of `Members`: live nodes (real `Member` views), charges, and calls, which
    run on the `FakeNode`s and are logged in `calls` as (node, method)."""

    def __init__(self, names: list[str], nodes: dict[str, Any] | None = None) -> None:
        self.nodes = nodes or {n: FakeNode(n) for n in names}
        self._live = {n: Member(n, self.nodes[n], NodeStats(n, "h", 1, 4, 0.0, 0.0, 8192, 0, 8192, 1 << 20, {}), 0.0)
                      for n in names}
        self.lost: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []

    def live(self) -> list[Member]:
        return list(self._live.values())

    def get(self, name: str) -> Member:
        if name not in self._live:
            raise UnavailableError(f"node {name} is lost: {self.lost.get(name)}")
        return self._live[name]

    def charge(self, name: str, mb: int) -> None:
        self._live[name].placing = max(0, self._live[name].placing + mb)

    def settle(self, name: str, sid: str, mb: int) -> None:
        self._live[name].placing -= mb
        self._live[name].placed[sid] = mb

    def release(self, name: str, sid: str, mb: int) -> None:
        self._live[name].placed.pop(sid, None)

    def call(self, name: str, method: str, *args: Any) -> Any:
        return self.invoke(name, method, *args)

    def invoke(self, name: str, method: str, *args: Any) -> Any:
        m = self.get(name)
        self.calls.append((name, method))
        return getattr(m.handle, method)(*args)

    def lose(self, name: str, why: str) -> None:
        del self._live[name]
        self.lost[name] = why


@pytest.fixture
def parts() -> SimpleNamespace:
    """Moves over three fake nodes; sandbox "s1" running on n0."""
    members, records = FakeMembers(["n0", "n1", "n2"]), Records()
    sandboxes = Sandboxes(FleetConfig(), members, records, Placer(members, "spread"))
    members.nodes["n0"].cks.add("base")
    records.held("base", "n0")
    records.note("n0", members.nodes["n0"].restore("base", "s1", None))
    return SimpleNamespace(members=members, records=records, moves=Moves(FleetConfig(), members, sandboxes))


def test_migrate_copies_the_checkpoint_drops_the_source_record_first_and_settles_the_charge(parts):
    info = parts.moves.migrate("s1", "n1")
    assert info.id == "s1" and parts.records.node_of("s1") == "n1"
    order = [c for c in parts.members.calls if c[1] in ("hibernate", "pull", "kill", "restore")]
    assert order[-4:] == [("n0", "hibernate"), ("n1", "pull"), ("n0", "kill"), ("n1", "restore")]
    assert [(t.source, t.target, t.bytes) for t in parts.moves.transfers] == [("n0", "n1", 4096)]
    assert "n1" in parts.records.holders(info.head)
    n1 = parts.members.get("n1")
    assert n1.placing == 0 and n1.placed == {"s1": MB}


def test_a_failed_restore_leaves_the_sandbox_hibernated_on_its_source_and_frees_the_charge(parts):
    parts.members.nodes["n1"].fail.add("restore")
    with pytest.raises(UnavailableError, match="as told"):
        parts.moves.migrate("s1", "n1")
    assert parts.members.nodes["n0"].sandboxes["s1"].state == "hibernated"
    assert parts.records.node_of("s1") == "n0"
    n1 = parts.members.get("n1")
    assert n1.placing == 0 and n1.placed == {}


def test_a_hibernated_sandbox_of_a_lost_node_resumes_elsewhere_from_a_copy(parts):
    ck = parts.moves.hibernate("s1").id  # replicated to a second node (FleetConfig.replicate_hibernated)
    assert len(parts.records.holders(ck)) == 2
    parts.members.lose("n0", "machine gone")
    parts.records.lost("n0", "machine gone")
    assert parts.moves.sandboxes.info("s1").state == "hibernated"
    parts.moves.resume("s1")
    assert parts.records.node_of("s1") in parts.records.holders(ck)
    assert parts.records.get("s1").last.state == "running"


def test_records_mark_a_lost_nodes_sandboxes_lost_unless_a_copy_lives_on():
    records = Records()
    spec = SandboxSpec(memory_mb=MB)
    records.note("n0", SandboxInfo("a", "running", spec, 1.0, None))
    records.note("n0", SandboxInfo("b", "hibernated", spec, 2.0, "ck"))
    records.held("ck", "n1")
    records.lost("n0", "gone")
    assert set(records.on_lost_nodes()) == {"a", "b"}
    assert records.get("b").last.state == "hibernated"
    with pytest.raises(InvalidStateError, match="node n0 lost: gone"):
        records.node_of("a")


class FakeCommandNode:
    """A node's command calls: one command "c1" with pid 7 that has exited with code 3."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def new_command(self, method: str, sid: str, *args: Any) -> tuple[str, int]:
        self.calls.append("new_command")
        return "c1", 7

    def look(self, cid: str, since: tuple[int, int], wait_s: float) -> tuple[bytes, bytes, bool, Exit]:
        self.calls.append("look")
        return b"out", b"", True, Exit(3, 0, 0, 3)

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append(method)
        return call


def test_commands_keep_pid_and_exit_from_calls_that_returned_them():
    node = FakeCommandNode()
    members = FakeMembers(["n0"], {"n0": node})
    records = Records()
    records.note("n0", SandboxInfo("s1", "running", SandboxSpec(memory_mb=MB), 1.0, None))
    commands = Commands(members, records.node_of)
    cid, follower = commands.start_followed("s1", "true")
    assert cid == "c1~n0" and follower.pid == 7 and node.calls == ["new_command"]  # the pid came with it
    assert follower.read() == [("stdout", b"out"), Exit(3, 0, 0, 3)] and follower.read() == []
    assert node.calls == ["new_command", "look"]  # the exit came with the look
    commands.release_command(cid)
    assert commands.split(cid) == ("c1", "n0") and node.calls[-1] == "release_command"
    for bad in ("c1", "c1~n9", "~n0"):
        with pytest.raises(NotFoundError):
            commands.split(bad)
