"""State moving between nodes through the content-addressed store: cross-node fork and restore (only
missing chunks travel), and migration of a hibernated sandbox (same id, its process alive)."""

from __future__ import annotations

import pytest
from fleet_helpers import count, counting_sandbox, runs_on

from k3sys.sandbox.errors import InvalidArgumentError, InvalidStateError, NotFoundError


def test_cross_node_fork_and_restore_move_only_missing_chunks(fleet):
    src = counting_sandbox(fleet, "n0", payload_mb=2)
    made = [src]
    try:
        at_fork = count(fleet, src)
        kid1 = fleet.fork(src, 1, nodes=["n1"])[0]
        made.append(kid1.id)
        first = fleet.transfers[-1]
        assert (first.source, first.target) == ("n0", "n1") and first.bytes > 2 << 20, first
        assert fleet.node_of(kid1.id) == "n1"
        runs_on(fleet, kid1.id, at_fork)

        kid2 = fleet.fork(src, 1, nodes=["n1"])[0]  # the same family again: n1 has nearly every chunk
        made.append(kid2.id)
        second = fleet.transfers[-1]
        assert second.target == "n1" and second.bytes < 0.05 * first.bytes, (first, second)
        runs_on(fleet, kid2.id, at_fork)

        ck = fleet.checkpoint(src)
        restored = fleet.restore(ck.id, node="n2")
        made.append(restored.id)
        assert fleet.node_of(restored.id) == "n2"
        assert fleet.read_file(restored.id, "/payload.bin") == fleet.read_file(src, "/payload.bin")
        runs_on(fleet, restored.id, at_fork)
        assert "n2" in fleet.records.holders(ck.id) and "n0" in fleet.records.holders(ck.id)
    finally:
        for sid in made:
            fleet.kill(sid)


def test_fork_over_nodes_when_asked_and_bad_node_lists(fleet):
    src = counting_sandbox(fleet, "n2")
    try:
        with pytest.raises(InvalidArgumentError, match="expected 2 node names"):
            fleet.fork(src, 2, nodes=["n0"])
        kids = fleet.fork(src, 3, nodes=["n2", "n0", "n1"])
        assert sorted(fleet.node_of(k.id) for k in kids) == ["n0", "n1", "n2"]
        for k in kids:
            runs_on(fleet, k.id, 1)
            fleet.kill(k.id)
    finally:
        fleet.kill(src)


def test_migration_of_a_hibernated_sandbox_keeps_id_and_process(fleet):
    sid = counting_sandbox(fleet, "n1")
    try:
        pids = {p.pid for p in fleet.processes(sid) if p.running}
        fleet.hibernate(sid)
        info = fleet.info(sid)
        assert info.state == "hibernated"
        # Every hibernation is replicated: a second node holds its checkpoint.
        assert len(fleet.records.holders(info.head)) >= 2
        moved = fleet.migrate(sid, node="n2")
        assert moved.id == sid and moved.state == "running" and fleet.node_of(sid) == "n2"
        assert pids <= {p.pid for p in fleet.processes(sid) if p.running}
        runs_on(fleet, sid, 1)
        assert sid not in {i.id for i in fleet.members.call("n1", "list")}  # forgotten at the source
        # A running sandbox migrates too (hibernated first), and back to a node it was on before.
        at = count(fleet, sid)
        fleet.migrate(sid, node="n1")
        assert fleet.node_of(sid) == "n1"
        runs_on(fleet, sid, at)
        with pytest.raises(InvalidArgumentError, match="already"):
            fleet.migrate(sid, node="n1")
        assert fleet.info(sid).state == "running"  # refused before anything was done
    finally:
        fleet.kill(sid)
    with pytest.raises(NotFoundError):
        fleet.info(sid)


def test_resume_goes_elsewhere_when_its_node_is_full(fleet):
    sid = counting_sandbox(fleet, "n0")
    try:
        at = count(fleet, sid)
        fleet.hibernate(sid)
        fleet.members.charge("n0", 1 << 30)  # n0 looks full until its next stats
        try:
            fleet.resume(sid)
        finally:
            fleet.members.charge("n0", -(1 << 30))
        assert fleet.node_of(sid) != "n0"
        runs_on(fleet, sid, at)
        with pytest.raises(InvalidStateError):
            fleet.resume(sid)
    finally:
        fleet.kill(sid)
