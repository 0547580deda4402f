"""E2B's pause through the official `e2b` SDK: answered once the sandbox is frozen, hibernated in the
background; a connect before that finished is a thaw (nothing restored), after it a restore with the
memory intact. Our view of the sandbox (`ours`, the k3sys client) tells which happened."""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox, SandboxState
from test_e2b_control import TEMPLATE, ours, server  # noqa: F401 (fixtures)
from waiting import wait_until

from k3sys.sandbox import CheckpointNotFoundError, InvalidStateError

pytestmark = pytest.mark.timeout(180)
# A counter held in the shell's memory: after a restore it goes on from where it was, not from 1.
LOOP = "sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/n; sleep 0.02; done'"


def _n(client, sid: str) -> int:
    # Retried: the loop truncates the file to write it.
    return int(wait_until(lambda: client.run(sid, "cat /tmp/n").stdout.strip(), 20, "the counter's file written"))


def _moves_on(client, sid: str, since: int) -> int:
    return wait_until(lambda: (n := _n(client, sid)) > since + 2 and n, 30, f"the counter going past {since}",
                      step=0.05)


@pytest.fixture
def counting(server, ours):  # noqa: F811
    with Sandbox.create(TEMPLATE, timeout=120) as s:
        ours.start_command(s.sandbox_id, LOOP)
        _moves_on(ours, s.sandbox_id, 0)
        yield s


def test_pause_answers_frozen_and_connect_right_after_is_a_thaw(counting, ours):  # noqa: F811
    sid = counting.sandbox_id
    cpu = ours.cpu_seconds(sid)
    t0 = time.perf_counter()
    assert counting.pause() is True
    answered = time.perf_counter() - t0
    info = ours.info(sid)
    assert info.state == "paused" and info.then_hibernate and info.head is None  # nothing durable yet
    assert counting.get_info().state == SandboxState.PAUSED
    assert counting.pause() is False  # 409: already paused
    frozen = ours.cpu_seconds(sid)
    time.sleep(0.2)  # "no CPU" needs a window: a running counter uses some within it, a frozen one none
    assert ours.cpu_seconds(sid) == frozen  # no CPU while paused
    with pytest.raises(InvalidStateError):
        ours.run(sid, "true")
    back = Sandbox.connect(sid)
    assert back.get_info().state == SandboxState.RUNNING
    info = ours.info(sid)
    # A thaw: no checkpoint was stored and the cgroup's CPU count went on (a restore starts it at 0).
    assert (info.state, info.then_hibernate, info.head) == ("running", False, None)
    assert Sandbox.list_snapshots(sandbox_id=sid).next_items() == []
    assert ours.cpu_seconds(sid) >= cpu > 0
    assert answered < 3.0, f"pause took {answered:.3f} s"  # not the dump's time (head is None); loose under load
    _moves_on(ours, sid, 0)


def test_connect_after_the_hibernation_is_a_restore(counting, ours):  # noqa: F811
    sid = counting.sandbox_id
    before = _n(ours, sid)
    assert counting.pause() is True

    def hibernated() -> bool:
        state = ours.info(sid).state
        assert state in ("paused", "hibernating", "hibernated"), state
        return state == "hibernated"

    wait_until(hibernated, 60, "the background hibernation", step=0.02)
    info = ours.info(sid)
    assert info.head is not None and not info.then_hibernate and ours.memory_bytes(sid) == 0
    assert counting.get_info().state == SandboxState.PAUSED  # E2B's view was "paused" throughout
    Sandbox.connect(sid)
    assert ours.info(sid).state == "running"
    _moves_on(ours, sid, before)  # counts on from where it was: the memory came back


def test_the_pause_checkpoint_is_not_a_snapshot_and_goes_with_the_sandbox(server, ours):  # noqa: F811
    # Issue 28, mismatch 4: it was listed by `list_snapshots()` and outlived the sandbox.
    with Sandbox.create(TEMPLATE, timeout=120) as s:
        snap = s.create_snapshot()
        pauses = []
        for _ in range(2):
            assert s.pause() is True
            deadline = time.monotonic() + 60
            while (info := ours.info(s.sandbox_id)).state != "hibernated":
                assert time.monotonic() < deadline, "never hibernated"
                time.sleep(0.02)
            pauses.append(info.head)
            listed = [x.snapshot_id for x in Sandbox.list_snapshots(sandbox_id=s.sandbox_id).next_items()]
            assert listed == [snap.snapshot_id]  # the user's snapshot, not the pause's
            Sandbox.connect(s.sandbox_id)
        with pytest.raises(CheckpointNotFoundError):
            ours.get_checkpoint(pauses[0])  # superseded by the second pause
        assert ours.get_checkpoint(pauses[1]).id == pauses[1]
        s.kill()
    with pytest.raises(CheckpointNotFoundError):
        ours.get_checkpoint(pauses[1])  # killed: its own checkpoint went with it
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert snap.snapshot_id not in {c.id for c in ours.checkpoints()}
