"""`pause(hibernate=True)`: answered once the sandbox is frozen, hibernated behind by a worker. A
resume before the end is a thaw (the same processes, nothing restored), after it a restore; kill,
a failing store and a runtime restart in the middle leave the sandbox usable or gone, never lost,
and nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from counting import COUNTER, assert_counting, criu_running, wait_for

from k3sys.sandbox import InvalidStateError, Runtime, Sandbox
from k3sys.sandbox.runtime.store import Store

pytestmark = pytest.mark.timeout(180)
SRC = str(Path(__file__).resolve().parents[3] / "src")
# Memory a shell holds, so that a dump takes long enough to be caught in the act.
BALLAST = "sh -c 'x=$(head -c {mb}000000 /dev/zero | tr \"\\0\" c); while :; do sleep 1000; done' >/dev/null 2>&1 &"


def counting_sandbox(rt: Runtime, ballast_mb: int = 0) -> Sandbox:
    s = Sandbox.create(runtime=rt, memory_mb=512)
    if ballast_mb:
        s.commands.run(BALLAST.format(mb=ballast_mb))
        wait_for(lambda: s.memory_bytes() > ballast_mb * 1_000_000, step=0.05)
    s.commands.run(COUNTER)
    assert_counting(s)
    return s


def wait_state(s: Sandbox, state: str, timeout: float = 60) -> None:
    wait_for(lambda: s.state == state, timeout=timeout, step=0.005)


def test_pause_answers_frozen_and_hibernates_behind(private_root, leak_check):
    with Runtime(private_root, hibernate_delay_s=1.0) as rt:
        s = counting_sandbox(rt)
        t0 = time.perf_counter()
        s.pause(hibernate=True)
        answered = time.perf_counter() - t0
        info = s.info
        assert (info.state, info.then_hibernate, info.head) == ("paused", True, None)  # nothing durable yet
        # The dump is not waited for (the state above says so); the bound is loose, a loaded machine is slow.
        assert answered < 3, f"pause took {answered:.3f} s"
        cpu = s.cpu_seconds()
        time.sleep(0.3)  # "no CPU" needs a window: a running counter uses some within it, a frozen one none
        assert s.cpu_seconds() == cpu  # frozen: no CPU at all
        with pytest.raises(InvalidStateError):
            s.pause(hibernate=True)  # a second pause while paused is refused
        init = rt.driver.init_pid(s.id)
        wait_state(s, "hibernated")
        info = s.info
        assert info.head is not None and not info.then_hibernate and s.memory_bytes() == 0
        assert rt.get_checkpoint(info.head).sandbox_id == s.id
        s.resume()  # a restore: new processes on the host, the same memory
        assert rt.driver.init_pid(s.id) != init
        assert_counting(s)
        s.kill()
    assert leak_check(private_root, {s.id}) == []


def test_resume_before_the_dump_is_a_thaw(private_root):
    with Runtime(private_root, hibernate_delay_s=2.0) as rt:
        s = counting_sandbox(rt)
        init = rt.driver.init_pid(s.id)
        s.pause(hibernate=True)
        t0 = time.perf_counter()
        s.resume()
        thaw = time.perf_counter() - t0
        assert thaw < 3, f"a thaw took {thaw:.3f} s"  # no restore (the pid says so); loose under load
        assert rt.driver.init_pid(s.id) == init  # the same processes: nothing was restored
        assert (s.state, s.info.then_hibernate) == ("running", False)
        # A later job, due after the dropped one, has run: had the dropped one stayed queued, it was due too.
        marker = Sandbox.create(runtime=rt, memory_mb=128)
        marker.pause(hibernate=True)
        wait_state(marker, "hibernated")
        # Only the marker's (its own: not listed, E2B's pause) was made: s's dropped job never ran.
        assert s.state == "running" and [m.meta["sandbox"] for m in rt.store.list()] == [marker.id]
        marker.kill()
        assert_counting(s)  # 1, 2, 3, ... with no gap
        s.kill()


def test_resume_during_the_dump_waits_for_it_then_thaws(private_root, leak_check):
    with Runtime(private_root, hibernate_delay_s=0.0) as rt:
        s = counting_sandbox(rt, ballast_mb=150)
        init = rt.driver.init_pid(s.id)
        s.pause(hibernate=True)
        wait_for(lambda: criu_running(private_root), step=0.002)  # the dump is under way
        s.resume()
        assert rt.driver.init_pid(s.id) == init and s.state == "running"
        # Cancelled during the dump: its images were dropped, nothing stored, no pack left.
        assert rt.checkpoints() == [] and s.info.head is None
        assert rt.store.stats()["packs"] == 0 and rt.store.verify() == []
        assert_counting(s)
        s.kill()
        wait_for(lambda: not any(rt.scratch.iterdir()), timeout=10, step=0.05)
    assert leak_check(private_root, {s.id}) == []
    assert list((private_root / "layers").iterdir()) == []


def test_kill_during_the_background_hibernation(private_root, leak_check):
    with Runtime(private_root, hibernate_delay_s=0.0) as rt:
        s = counting_sandbox(rt, ballast_mb=150)
        s.pause(hibernate=True)
        wait_for(lambda: criu_running(private_root), step=0.002)
        s.kill()
        assert rt.list() == []
        wait_for(lambda: not any(rt.scratch.iterdir()), timeout=10, step=0.05)
        assert rt.store.verify() == []
        for ck in rt.checkpoints():  # one kept if the kill came after the commit; it deletes cleanly
            rt.delete_checkpoint(ck.id)
        assert rt.store.stats()["packs"] == 0
    assert leak_check(private_root, {s.id}) == []
    assert list((private_root / "layers").iterdir()) == []


def test_failing_background_hibernation_leaves_a_resumable_sandbox(private_root, monkeypatch):
    with Runtime(private_root, hibernate_delay_s=0.0) as rt:
        s = counting_sandbox(rt)
        first = s.checkpoint()

        def full_disk(self, *args, **kwargs):
            raise OSError(28, "No space left on device (injected)")

        monkeypatch.setattr(Store, "commit", full_disk)
        init = rt.driver.init_pid(s.id)
        s.pause(hibernate=True)
        # The record drops the intent, then gets the reason (two writes): wait for both.
        wait_for(lambda: not s.info.then_hibernate and s.info.reason, timeout=60, step=0.01)
        info = s.info
        assert info.state == "paused" and "background hibernation failed" in info.reason
        assert "No space left" in info.reason and info.head == first.id
        monkeypatch.undo()
        s.resume()  # frozen all along: a thaw
        assert rt.driver.init_pid(s.id) == init
        assert_counting(s)
        assert [c.id for c in rt.checkpoints()] == [first.id] and rt.store.verify() == []
        s.pause(hibernate=True)  # and the next one works
        wait_state(s, "hibernated")
        s.resume()
        assert_counting(s)
        s.kill()


def test_filesystem_only_resume_finishes_the_hibernation_first(private_root):
    with Runtime(private_root, hibernate_delay_s=30.0) as rt:
        s = counting_sandbox(rt)
        s.pause(hibernate=True)
        rt.resume(s.id, memory=False)  # hibernates now, then boots cold: files kept, processes not
        assert s.state == "running" and s.info.head is not None
        assert s.files.read_text("/tmp/log")  # the files are kept
        # The processes are not: asked of the process list (no wait proves that a file stays still).
        assert "counter.pid" not in s.commands.run("ps -o args").stdout
        assert [p for p in s.commands.list() if p.running] == []
        s.kill()


def test_the_checkpoint_is_exactly_the_paused_state(private_root):
    """The dump of a sandbox frozen by the pause runs without a thaw: a shell appending as fast as it
    can has written not one line more in the checkpoint than when the pause answered."""
    with Runtime(private_root, hibernate_delay_s=0.0) as rt:
        s = Sandbox.create(runtime=rt, memory_mb=512)
        s.commands.run("sh -c 'i=0; while :; do i=$((i+1)); echo $i; done > /tmp/fast' >/dev/null 2>&1 &")
        wait_for(lambda: s.files.exists("/tmp/fast"), step=0.01)
        s.pause(hibernate=True)
        upper = rt.table.dirs(s.id).upper / "tmp" / "fast"
        at_pause = upper.read_bytes()  # the host's view of the frozen sandbox's file
        wait_state(s, "hibernated")
        rt.resume(s.id, memory=False)  # its files as the checkpoint has them
        assert s.files.read("/tmp/fast", format="bytes") == at_pause and len(at_pause.splitlines()) > 10
        s.kill()


def test_synchronous_hibernate_takes_over_a_queued_one(private_root):
    with Runtime(private_root, hibernate_delay_s=30.0) as rt:
        s = counting_sandbox(rt)
        s.pause(hibernate=True)
        ck = s.hibernate()
        assert s.state == "hibernated" and s.info.head == ck.id and not s.info.then_hibernate
        assert rt.hibernator.pending() == 0
        s.resume()
        assert_counting(s)
        s.kill()


def test_a_queued_hibernation_survives_a_runtime_restart(private_root, leak_check):
    with Runtime(private_root, hibernate_delay_s=60.0) as rt:
        s = counting_sandbox(rt)
        s.pause(hibernate=True)
    # Closed before its turn: the record keeps the intent, and the next runtime carries it out.
    with Runtime(private_root, hibernate_delay_s=0.0) as rt:
        s = Sandbox.get(s.id, runtime=rt)
        wait_state(s, "hibernated")
        s.resume()
        assert_counting(s)
        s.kill()
    assert leak_check(private_root, {s.id}) == []


# A runtime that dies (SIGKILL) in the middle of a background hibernation's dump.
CHILD = textwrap.dedent("""
    import json, sys
    from k3sys.sandbox import Runtime, Sandbox
    rt = Runtime(sys.argv[1], hibernate_delay_s=0.0)
    s = Sandbox.create(runtime=rt, memory_mb=512)
    s.commands.run(sys.argv[2])
    s.commands.run(sys.argv[3])
    s.commands.run("for i in $(seq 400); do test -s /tmp/log && exit 0; sleep 0.05; done")
    s.pause(hibernate=True)
    print(json.dumps({"sandbox": s.id}), flush=True)
    sys.stdin.read()
""")


def test_runtime_killed_during_a_background_dump(private_root, leak_check):
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(private_root), BALLAST.format(mb=150), COUNTER],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": SRC})
    try:
        sid = json.loads(p.stdout.readline())["sandbox"]
        wait_for(lambda: criu_running(private_root), step=0.002)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    wait_for(lambda: not criu_running(private_root))
    # Adopted frozen (rolled back from the dump) with the intent kept: hibernated again.
    with Runtime(private_root, hibernate_delay_s=0.0) as rt:
        s = Sandbox.get(sid, runtime=rt)
        assert s.state in ("paused", "hibernating", "hibernated")
        wait_state(s, "hibernated")
        assert rt.store.verify() == []
        s.resume()
        assert_counting(s)
        s.kill()
    assert leak_check(private_root, {sid}) == []
