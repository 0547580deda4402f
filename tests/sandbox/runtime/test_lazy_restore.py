"""Lazy restore (drivers/lazypages.py): resume and restore let the sandbox run while `criu lazy-pages`
brings its memory back; every byte arrives, the images stay until it has, a dump waits for it,
and a daemon that fails takes the sandbox's processes with it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from counting import wait_for
from sandbox_fixtures import run_any

from k3sys.sandbox import DriverError, Runtime, Sandbox
from k3sys.sandbox.runtime.drivers.lazypages import LazyPages, guard, release
from k3sys.sandbox.runtime.drivers.pageserver import PageServer
from k3sys.sandbox.runtime.drivers.runc import RuncDriver
from k3sys.sandbox.runtime.system import system_paths

pytestmark = [pytest.mark.timeout(300), pytest.mark.embedded]

MIB = 96


def holder(make: str, tag: str = "") -> str:
    """A shell command that starts a process keeping what the Python lines `make` build resident
    (they define `digest()`, its SHA-256); each time /tmp/<tag>check appears it writes `digest()` to
    /tmp/<tag>sum (and removes the trigger). Returns once /tmp/<tag>ready says all is resident."""
    return ("python3 -c 'import hashlib, mmap, os, random, time\n"
            f"{make}\n"
            f"open(\"/tmp/{tag}ready\", \"w\").close()\n"
            "while True:\n"
            f"    if os.path.exists(\"/tmp/{tag}check\"):\n"
            f"        open(\"/tmp/{tag}sum.tmp\", \"w\").write(digest()); "
            f"os.rename(\"/tmp/{tag}sum.tmp\", \"/tmp/{tag}sum\")\n"
            f"        os.unlink(\"/tmp/{tag}check\")\n"
            f"    time.sleep(0.02)' >/dev/null 2>&1 & while [ ! -e /tmp/{tag}ready ]; do sleep 0.05; done")


# MIB MiB of random bytes in private memory.
HOLDER = holder(f"b = [random.randbytes(1 << 20) for _ in range({MIB})]\n"
                "def digest():\n    h = hashlib.sha256()\n    [h.update(x) for x in b]\n    return h.hexdigest()")
# 8 MiB of random bytes in anonymous shared memory (CRIU restores it eagerly, from the page image
# the resume writes before the sandbox runs).
SHARED = holder("m = mmap.mmap(-1, 8 << 20, mmap.MAP_SHARED)\nm[:] = random.randbytes(8 << 20)\n"
                "def digest():\n    return hashlib.sha256(m).hexdigest()", "sh")


def memory_sum(s: Sandbox, tag: str = "") -> str:
    """The SHA-256 the holder tagged `tag` computes of its bytes now."""
    assert s.commands.run(f"rm -f /tmp/{tag}sum; touch /tmp/{tag}check").exit_code == 0
    wait_for(lambda: run_any(s, f"test -e /tmp/{tag}sum").exit_code == 0, timeout=60, step=0.05)
    return s.files.read_text(f"/tmp/{tag}sum")


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
        work = rt.root / "sandboxes" / s.id / "logs" / "restore"
        # The daemon ran (its log is made as it starts), and CRIU got a userfaultfd.
        assert (work / "lazy-pages.log").exists()
        assert "Unable to open an userfaultfd" not in (work / "restore.log").read_text()
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


def test_a_lazy_resume_reads_its_pages_from_the_store(rt):
    """A hardened sandbox resumed from the store: its page images are not checked out (the pages
    CRIU restores itself are written, the rest served from the packs), its private and shared
    memory come back whole, and a fork and a checkpoint right away (the daemon may still be
    serving) keep every byte."""
    if not rt.driver.lazy.supported:
        pytest.skip("this kernel or CRIU cannot restore lazily (no userfaultfd)")
    with Sandbox.create("base", runtime=rt, memory_mb=MIB + 256) as s:
        assert s.commands.run(HOLDER, timeout=120).exit_code == 0
        assert s.commands.run(SHARED, timeout=120).exit_code == 0
        want, want_shared = memory_sum(s), memory_sum(s, "sh")
        s.hibernate()
        s.resume()
        t = rt.timings(s.id)
        assert "pages" in t and t["criu"] < 1.0  # page images filled by range, the memory lazily
        (kid,) = s.fork(1)
        with kid:
            assert memory_sum(kid) == want and memory_sum(kid, "sh") == want_shared
        ck = s.checkpoint()
        assert memory_sum(s) == want and memory_sum(s, "sh") == want_shared
        with Sandbox.restore(ck.id, runtime=rt) as r:
            assert memory_sum(r) == want and memory_sum(r, "sh") == want_shared


def test_a_failing_page_source_kills_the_sandbox(rt, monkeypatch):
    """The store cannot give the daemon a page (a read fails): the daemon fails on the closed
    socket and the sandbox's processes are killed, never left running on pages that did not come."""
    if not rt.driver.lazy.supported:
        pytest.skip("this kernel or CRIU cannot restore lazily (no userfaultfd)")
    fill = PageServer.fill

    def failing(self: PageServer, lazy: bool) -> int:
        def read(name: str, offset: int, n: int) -> bytes:
            raise OSError("the store's disk went away")

        try:
            return fill(self, lazy)
        finally:
            self._read = read  # the eager pages are in place, every lazy one fails

    with Sandbox.create("base", runtime=rt, memory_mb=MIB + 256) as s:
        assert s.commands.run(HOLDER, timeout=120).exit_code == 0
        want = memory_sum(s)
        s.hibernate()
        monkeypatch.setattr(PageServer, "fill", failing)
        t0 = time.monotonic()
        try:
            s.resume()
        except DriverError:
            # The daemon failed while CRIU still restored: the restore fails at once (its processes
            # are killed, not left waiting on a fault) and the sandbox stays hibernated, intact.
            monkeypatch.undo()
            assert time.monotonic() - t0 < 60 and s.info.state == "hibernated"
            s.resume()
            assert memory_sum(s) == want
            return
        monkeypatch.undo()
        # It failed once the sandbox ran: its processes are killed.
        with contextlib.suppress(DriverError):  # raised to whichever settles first (the runtime's cleanup, or us)
            rt.driver.settle(s.id)
        wait_for(lambda: rt.driver.memory_bytes(s.id) < 32 << 20, timeout=60, step=0.05)


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
    lazy = LazyPages(criu, dict(os.environ), lambda sid: None, lambda sid: tmp_path / "procs")
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(DriverError, match=r"sandbox s1: criu lazy-pages did not start"):
        lazy.start("s1", tmp_path / "no-images", work, timeout=5)
    lazy.settle("s1")  # nothing was registered


def test_guard_kills_unless_settled(tmp_path: Path):
    """The guard of a lazy restore kills what its cgroup lists when its stdin closes without
    "settled" (the runtime died), and nothing once told."""
    victims = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        procs = tmp_path / "cgroup.procs"
        procs.write_text(f"{victims[0].pid}\n")
        release(guard(procs))  # returns once the guard has exited
        # A kill it sent on its way out lands within this window. No later event orders after a kill
        # that did not happen; the window only shrinks the chance of missing one, it cannot fail.
        time.sleep(0.2)
        assert victims[0].poll() is None  # settled: spared
        procs.write_text(f"{victims[0].pid}\n{victims[1].pid}\n")
        g = guard(procs)
        g.stdin.close()  # what the runtime's death does
        assert [v.wait(10) for v in victims] == [-signal.SIGKILL] * 2
        procs.write_text("")  # the cgroup is empty: the guard is done
        assert g.wait(10) == 0
    finally:
        for v in victims:
            v.kill()
            v.wait()


def test_guard_kills_a_frozen_cgroup():
    """A sandbox paused (frozen) while its memory streamed in: the guard thaws it to kill it."""
    cg = Path(f"/sys/fs/cgroup/freezer/k3sys-test-guard-{os.getpid()}")
    if not cg.parent.is_dir():
        pytest.skip("no cgroup v1 freezer here")
    cg.mkdir()
    victim = subprocess.Popen(["sleep", "60"])
    try:
        (cg / "cgroup.procs").write_text(str(victim.pid))
        (cg / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (cg / "freezer.state").read_text().strip() == "FROZEN", timeout=10, step=0.01)
        g = guard(cg / "cgroup.procs")
        g.stdin.close()
        assert victim.wait(10) == -signal.SIGKILL
        assert g.wait(10) == 0
    finally:
        victim.kill()
        victim.wait()
        (cg / "freezer.state").write_text("THAWED")
        cg.rmdir()


# A runtime that resumes a hardened 512 MiB sandbox lazily and dies the moment the resume returns:
# its page server dies with it, so the daemon cannot finish.
DOOMED = textwrap.dedent("""
    import json, os, sys
    from k3sys.sandbox import Runtime, Sandbox
    rt = Runtime(sys.argv[1])
    s = Sandbox.create("base", runtime=rt, memory_mb=768)
    assert s.commands.run(sys.argv[2], timeout=120).exit_code == 0
    s.hibernate()
    s.resume()
    print(json.dumps({"sandbox": s.id, "daemon": rt.driver.lazy._daemons.get(s.id) is not None}), flush=True)
    os.kill(os.getpid(), 9)
""")


def test_a_runtime_that_dies_mid_delivery_takes_the_sandbox_with_it(tmp_path: Path):
    """Pages the daemon had not delivered would read as zeros once it exits: the sandbox's
    processes are killed instead (lazypages.guard), and a new runtime finds it without them."""
    src = str(Path(__file__).resolve().parents[3] / "src")
    holder = HOLDER.replace(f"range({MIB})", "range(512)")
    p = subprocess.run([sys.executable, "-c", DOOMED, str(tmp_path / "rt"), holder], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": src}, timeout=240)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    info = json.loads(p.stdout)
    if not info["daemon"]:
        pytest.skip("the restore was not lazy here (no userfaultfd)")
    procs = Path(f"/sys/fs/cgroup/freezer/k3sys-{info['sandbox']}/cgroup.procs")
    if not procs.exists():
        procs = Path(f"/sys/fs/cgroup/k3sys-{info['sandbox']}/cgroup.procs")
    wait_for(lambda: not procs.exists() or not procs.read_text().strip(), timeout=30, step=0.05)
    with Runtime(tmp_path / "rt") as rt:
        assert rt.info(info["sandbox"]).state != "running"
        rt.kill_all()
