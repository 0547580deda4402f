"""The service's restart behaviour: killed (SIGKILL) during a checkpoint, or stopped (SIGTERM, which
hibernates what holds memory), a new service on the same directory finds every sandbox in a truthful
state and every earlier checkpoint intact. And the timeout reaper: hibernate (default) or kill."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import pytest
from counting import COUNTER, assert_counting, criu_running, wait_for
from service_process import BALLAST, ServiceProcess

from k3sys.sandbox import Checkpoint, Sandbox, SandboxError
from k3sys.sandbox.errors import InvalidStateError

pytestmark = pytest.mark.timeout(240)


def states(rt) -> dict[str, str]:
    return {i.id: i.state for i in rt.list()}


def test_sigkill_during_checkpoint_then_restart(tmp_path, leak_check):
    root = tmp_path / "svc"
    svc = ServiceProcess(root).start()
    with svc.client() as rt:
        victim = Sandbox.create(runtime=rt, memory_mb=256, id="victim")
        victim.commands.run(COUNTER)
        victim.commands.run(BALLAST.format(mb=40))  # so a dump takes long enough to be caught in
        n = assert_counting(victim)[-1]
        ck1 = victim.checkpoint()
        sleeper = Sandbox.create(runtime=rt, memory_mb=64, id="sleeper")
        sleeper.files.write("/root/note", "asleep")
        sleeper.hibernate()
        Sandbox.create(runtime=rt, memory_mb=64, id="frozen").pause()

        def checkpoint_forever() -> None:
            with contextlib.suppress(SandboxError):
                while True:
                    victim.checkpoint()

        loop = threading.Thread(target=checkpoint_forever)
        loop.start()
        try:
            wait_for(lambda: criu_running(root))
        finally:
            svc.stop(signal.SIGKILL)
            loop.join(60)
    wait_for(lambda: not criu_running(root))  # the orphaned dump finishes or dies; nobody thaws the sandbox

    with ServiceProcess(root) as svc, svc.client() as rt:
        assert states(rt) == {"victim": "running", "sleeper": "hibernated", "frozen": "paused"}
        v = Sandbox.get("victim", runtime=rt)
        assert_counting(v, n)  # thawed, counting on, nothing lost or repeated
        assert ck1 in Checkpoint.list(runtime=rt)
        with Sandbox.restore(ck1, runtime=rt) as old:
            assert assert_counting(old)[0] == 1
        assert v.checkpoint().parent is not None
        s = Sandbox.get("sleeper", runtime=rt)
        s.resume()
        assert s.files.read_text("/root/note") == "asleep"
        Sandbox.get("frozen", runtime=rt).resume()
        assert svc.kill_all() == {"victim", "sleeper", "frozen"}
    assert leak_check(root, {"victim", "sleeper", "frozen"}) == []


def test_sigterm_hibernates_and_restart_resumes(tmp_path, leak_check):
    root = tmp_path / "svc"
    with ServiceProcess(root) as svc, svc.client() as rt:
        a = Sandbox.create(runtime=rt, memory_mb=128, id="a")
        a.commands.run(COUNTER)
        n = assert_counting(a)[-1]
        ck = a.checkpoint()
        Sandbox.create(runtime=rt, memory_mb=64, id="b").pause()
        Sandbox.create(runtime=rt, memory_mb=64, id="c").hibernate()
        assert svc.stop(signal.SIGTERM) == -signal.SIGTERM  # uvicorn re-raises the signal once shut down
    # Stopped: no process, mount or cgroup of any sandbox is left; only their records and checkpoints.
    assert [x for x in leak_check(root, {"a", "b", "c"}) if not x.startswith("sandbox dir")] == []

    with ServiceProcess(root) as svc, svc.client() as rt:
        assert states(rt) == {"a": "hibernated", "b": "hibernated", "c": "hibernated"}
        assert ck in Checkpoint.list(runtime=rt)
        a = Sandbox.get("a", runtime=rt)
        a.resume()  # on demand
        assert_counting(a, n)
        assert svc.kill_all() == {"a", "b", "c"}
    assert leak_check(root, {"a", "b", "c"}) == []


def test_timeout_reaper_hibernates_by_default_or_kills(service):
    with service.client() as rt:
        # The write, and the read after the resume, must each come before the timeout runs out: 3 s
        # is room for them on a quiet machine; a loaded one gets a longer timeout (the reaper's rule is
        # the same whatever its length), so the test waits on the machine instead of failing on it.
        for timeout_s in (3, 6, 12, 24):
            s = Sandbox.create(runtime=rt, memory_mb=64, timeout_s=timeout_s)  # the service's default: hibernate
            try:
                s.files.write("/root/k", "kept")
                t0 = time.monotonic()
                wait_for(lambda s=s: s.state == "hibernated", timeout=20 + timeout_s, step=0.05)
                assert time.monotonic() - t0 > 0.5
                assert f"timeout_s={timeout_s}" in s.info.reason and s.memory_bytes() == 0
                s.resume()
                assert s.files.read_text("/root/k") == "kept" and s.info.reason == ""
                break
            except InvalidStateError:  # the timeout ran out before a call reached the sandbox: too slow for it
                s.kill()
        else:
            pytest.fail("the sandbox hibernated before a call reached it, even with a 24 s timeout")
        wait_for(lambda: s.state == "hibernated", timeout=20 + timeout_s, step=0.05)  # a fresh timeout after resume
        s.kill()
        k = Sandbox.create(runtime=rt, memory_mb=64, timeout_s=1, on_timeout="kill")
        wait_for(lambda: k not in Sandbox.list(runtime=rt), timeout=15, step=0.05)
