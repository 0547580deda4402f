"""Lazy restore (drivers/lazypages.py): resume and restore let the sandbox run while `criu lazy-pages`
brings its memory back; every byte arrives, the images stay until it has, a dump waits for it,
and a daemon that fails takes the sandbox's processes with it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from counting import wait_for

from k3sys.sandbox import DriverError, Runtime, Sandbox
from k3sys.sandbox.runtime.drivers.lazypages import LazyPages
from k3sys.sandbox.runtime.drivers.runc import RuncDriver
from k3sys.sandbox.runtime.system import system_paths

pytestmark = [pytest.mark.timeout(300), pytest.mark.embedded]

MIB = 96
# A process holding MIB MiB of random bytes; each time /tmp/check appears it writes their SHA-256
# to /tmp/sum (and removes the trigger). /tmp/ready: the bytes are resident.
HOLDER = ("python3 -c 'import hashlib, os, random, time\n"
          f"b = [random.randbytes(1 << 20) for _ in range({MIB})]\n"
          "open(\"/tmp/ready\", \"w\").close()\n"
          "while True:\n"
          "    if os.path.exists(\"/tmp/check\"):\n"
          "        h = hashlib.sha256()\n"
          "        [h.update(x) for x in b]\n"
          "        open(\"/tmp/sum.tmp\", \"w\").write(h.hexdigest()); os.rename(\"/tmp/sum.tmp\", \"/tmp/sum\")\n"
          "        os.unlink(\"/tmp/check\")\n"
          "    time.sleep(0.02)' >/dev/null 2>&1 & while [ ! -e /tmp/ready ]; do sleep 0.05; done")


def memory_sum(s: Sandbox) -> str:
    """The holder's SHA-256 of its bytes, computed now."""
    assert s.commands.run("rm -f /tmp/sum; touch /tmp/check").exit_code == 0
    wait_for(lambda: s.commands.run("test -e /tmp/sum").exit_code == 0, timeout=60, step=0.05)
    return s.files.read_text("/tmp/sum")


@pytest.fixture(scope="module")
def lazy_rt(tmp_path_factory):
    """A runtime whose sandboxes run without a user namespace (CRIU's restorer calls userfaultfd(2)
    itself there; in one, it opens /dev/userfaultfd: both paths are tested)."""
    root = tmp_path_factory.mktemp("lazy")
    rt = Runtime(root, driver=RuncDriver(root, hardened=False))
    if not rt.driver.lazy.supported:
        rt.close()
        pytest.skip("this kernel or CRIU cannot restore lazily (no userfaultfd)")
    yield rt
    rt.kill_all()
    rt.close()


def test_a_sandbox_in_a_user_namespace_resumes_lazily_and_whole(rt):
    """Hardened sandboxes restore lazily too (/dev/userfaultfd, criu-4.1-5 patch), and the device
    CRIU needed is taken back from the sandbox's cgroup once the restore is done."""
    if not rt.driver.lazy.supported:
        pytest.skip("this kernel or CRIU cannot restore lazily (no userfaultfd)")
    with Sandbox.create("base", runtime=rt, memory_mb=MIB + 256) as s:
        assert s.commands.run(HOLDER, timeout=120).exit_code == 0
        want = memory_sum(s)
        s.hibernate()
        s.resume()
        log = (rt.root / "sandboxes" / s.id / "logs" / "restore" / "restore.log").read_text()
        assert "Lazy restore skips" in log and "Unable to open an userfaultfd" not in log
        devices = Path(f"/sys/fs/cgroup/devices/k3sys-{s.id}/devices.list")
        if devices.exists():  # cgroup v1: the rule was taken back
            assert "c 10:257" not in devices.read_text()
        assert memory_sum(s) == want


@pytest.mark.parametrize("which", ["rt", "lazy_rt"], ids=["userns", "no-userns"])
def test_resume_restore_and_checkpoint_keep_every_byte(which, request):
    rt = request.getfixturevalue(which)
    if not rt.driver.lazy.supported:
        pytest.skip("this kernel or CRIU cannot restore lazily (no userfaultfd)")
    with Sandbox.create("base", runtime=rt, memory_mb=MIB + 256) as s:
        assert s.commands.run(HOLDER, timeout=120).exit_code == 0
        want = memory_sum(s)
        s.hibernate()
        s.resume()
        assert rt.timings(s.id)["criu"] < 1.0  # the restore did not copy MIB MiB first
        # Right after the resume (the daemon may still be pushing pages): a checkpoint settles first.
        ck = s.checkpoint()
        assert memory_sum(s) == want
        with Sandbox.restore(ck.id, runtime=rt) as r:
            assert memory_sum(r) == want
        # Once delivered, the daemons are gone and their images deleted.
        wait_for(lambda: not rt.driver.lazy._daemons and not list(rt.scratch.iterdir()), timeout=60, step=0.05)


def test_failed_daemon_kills_the_sandbox(lazy_rt):
    """A daemon killed mid-delivery: settle reports it and the sandbox's processes are gone (they
    must not run on with pages that never came)."""
    rt = lazy_rt
    with Sandbox.create("base", runtime=rt, memory_mb=512 + 256) as s:
        assert s.commands.run(HOLDER.replace(f"range({MIB})", "range(512)"), timeout=120).exit_code == 0
        s.hibernate()
        s.resume()
        d = rt.driver.lazy._daemons.get(s.id)
        if d is None or d.poll() is not None:
            pytest.skip("the daemon delivered 512 MiB before it could be killed")
        os.kill(d.pid, signal.SIGKILL)
        if d.wait() == 0:  # it finished between the look and the signal
            pytest.skip("the daemon delivered 512 MiB before it could be killed")
        with pytest.raises(DriverError, match=r"lazy-pages failed \(status -9\).*killed"):
            rt.driver.settle(s.id)
        assert rt.driver.memory_bytes(s.id) < 64 << 20
        rt.driver.settle(s.id)  # once reported, settled


def test_daemon_that_cannot_start_is_a_driver_error(tmp_path: Path):
    criu = system_paths().criu
    if not criu.exists():
        pytest.skip("no CRIU")
    lazy = LazyPages(criu, dict(os.environ), lambda sid: None)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(DriverError, match=r"sandbox s1: criu lazy-pages did not start"):
        lazy.start("s1", tmp_path / "no-images", work, timeout=5)
    lazy.settle("s1")  # nothing was registered
