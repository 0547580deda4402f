"""Concurrency through the service: 20 sandboxes driven by 20 threads, and a slow checkpoint that must
not stall other sandboxes' calls. Nothing may leak. (Racing calls on one sandbox: test_concurrency.py,
which runs against the service too.)"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from service_process import BALLAST, ServiceProcess
from waiting import wait_until

from k3sys.sandbox import Sandbox

pytestmark = pytest.mark.timeout(300)


def test_twenty_sandboxes_twenty_threads(tmp_path, leak_check):
    root = tmp_path / "svc"
    ids: set[str] = set()
    mu = threading.Lock()

    def remember(*sandboxes: Sandbox) -> None:
        with mu:
            ids.update(s.id for s in sandboxes)

    with ServiceProcess(root) as svc, svc.client() as rt:

        def life(i: int) -> str:
            s = Sandbox.create(runtime=rt, memory_mb=64, id=f"load-{i:02d}")
            remember(s)
            s.files.write("/root/who", s.id)
            assert s.commands.run("cat /root/who; echo 1 > /root/n").stdout == s.id
            s.pause()
            assert s.state == "paused"
            s.resume()
            ck = s.checkpoint()
            assert (ck.sandbox_id, s.state) == (s.id, "running")
            s.commands.run("echo 2 > /root/n")
            (kid,) = s.fork(1)
            remember(kid)
            assert kid.files.read_text("/root/who") == s.id and kid.files.read_text("/root/n") == "2\n"
            kid.commands.run("echo kid > /root/n")
            assert s.files.read_text("/root/n") == "2\n"  # the fork is a copy, not a view
            kid.kill()
            s.kill()
            return ck.id

        with ThreadPoolExecutor(20) as pool:
            cks = list(pool.map(life, range(20)))
        assert rt.list() == []
        assert len(set(cks)) == 20 and set(cks) <= {c.id for c in rt.checkpoints()}
        with Sandbox.restore(cks[7], runtime=rt) as r:  # a checkpoint taken among 19 others is intact
            assert r.files.read_text("/root/who") == "load-07" and r.files.read_text("/root/n") == "1\n"
            remember(r)
    assert len(ids) == 41
    assert leak_check(root, ids) == []


def test_slow_checkpoint_does_not_stall_other_sandboxes(service):
    with service.client() as rt, Sandbox.create(runtime=rt, memory_mb=384) as big, \
            Sandbox.create(runtime=rt, memory_mb=64) as small:
        big.commands.run(BALLAST.format(mb=80))
        wait_until(lambda: big.memory_bytes() >= 80e6, 30, "the ballast growing", step=0.1)
        span: list[float] = []
        worker = threading.Thread(target=lambda: (span.append(time.monotonic()), big.checkpoint(),
                                                  span.append(time.monotonic())))
        worker.start()
        during = []
        while worker.is_alive():
            t0 = time.monotonic()
            assert small.commands.run("echo fine").stdout == "fine\n"
            during.append((t0, time.monotonic() - t0))
        worker.join()
        inside = [dt for t0, dt in during if t0 + dt < span[1]]
        took = span[1] - span[0]
        assert len(inside) >= 2, f"only {len(inside)} calls on another sandbox during a {took:.2f} s checkpoint"
        assert max(inside) < took / 2
