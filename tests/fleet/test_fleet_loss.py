"""Losing a node: its running sandboxes are reported lost within 10 s, the other nodes keep serving,
new sandboxes go elsewhere, and what was replicated (a hibernation, a checkpoint) comes back on another
node. The node lost is a fourth one this test adds, so the others stay for the rest of the session."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from fleet_helpers import count, counting_sandbox, runs_on
from waiting import wait_until

from k3sys.sandbox import Sandbox
from k3sys.sandbox.errors import InvalidStateError, NotFoundError, SandboxError, UnavailableError
from k3sys.sandbox.spec import SandboxSpec

# lost_after_s (4 s, conftest.py) and a heartbeat (0.5 s), with room for a loaded machine's late heartbeats and calls.
LOST_WITHIN_S = 20.0


def state(fleet, sid: str) -> str:
    """The sandbox's state; "unreachable" while its node does not answer but is not lost yet (503)."""
    try:
        return fleet.info(sid).state
    except UnavailableError:
        return "unreachable"


def test_node_loss(cluster, fleet, gateway):
    cluster.add("n3", cluster.homes["n0"].parent)
    wait_until(lambda: hasattr(fleet.nodes().get("n3"), "pid"), 10, "n3 joining", step=0.1)
    running = [fleet.create(SandboxSpec(memory_mb=128), node="n3").id for _ in range(2)]
    hib = counting_sandbox(fleet, "n3")
    at_hibernate = count(fleet, hib)
    fleet.hibernate(hib)
    assert set(fleet.records.holders(fleet.info(hib).head)) - {"n3"}, "the hibernation was not replicated"
    src = counting_sandbox(fleet, "n3")
    at_checkpoint = count(fleet, src)
    ck = fleet.checkpoint(src)
    assert fleet.replicate(ck.id).target != "n3"
    other = fleet.create(SandboxSpec(memory_mb=128), node="n0").id
    made = [*running, hib, src, other]
    try:
        os.kill(fleet.nodes()["n3"].pid, signal.SIGKILL)  # the node actor's process, then the Ray node's
        cluster.cluster.remove_node(cluster.raynodes["n3"], allow_graceful=False)
        t0 = time.monotonic()
        wait_until(lambda: state(fleet, running[0]) == "lost", LOST_WITHIN_S, "the node's sandbox reported lost",
                   step=0.1)
        print(f"lost after {time.monotonic() - t0:.2f} s")
        for sid in (*running, src):
            info = fleet.info(sid)
            assert info.state == "lost" and "node n3 lost" in info.reason, info
        assert {i.id: i.state for i in fleet.list()}[running[1]] == "lost"
        assert Sandbox.get(running[0], api_url=gateway).state == "lost"
        with pytest.raises(InvalidStateError, match="lost"):
            fleet.run(running[0], "true")
        assert "n3" in fleet.nodes() and isinstance(fleet.nodes()["n3"], str)

        # The rest keeps working; new sandboxes go to the nodes left.
        assert fleet.run(other, "echo ok").stdout == "ok\n"
        fresh = [Sandbox.create(memory_mb=128, api_url=gateway) for _ in range(3)]
        made += [s.id for s in fresh]
        assert {fleet.node_of(s.id) for s in fresh} <= {"n0", "n1", "n2"}
        assert fresh[0].commands.run("echo hi").stdout == "hi\n"

        # A hibernation and a replicated checkpoint come back elsewhere, processes and all.
        assert fleet.info(hib).state == "hibernated"
        fleet.resume(hib)
        assert fleet.node_of(hib) != "n3"
        runs_on(fleet, hib, at_hibernate)
        restored = fleet.restore(ck.id)
        made.append(restored.id)
        assert fleet.node_of(restored.id) != "n3"
        runs_on(fleet, restored.id, at_checkpoint)
    finally:
        for sid in made:
            with contextlib.suppress(SandboxError):  # cleanup: the test's own failure matters
                fleet.kill(sid)
    with pytest.raises(NotFoundError):
        fleet.info(running[0])  # a lost sandbox killed is forgotten
