"""Processes keep their memory, open files and loopback TCP connections across pause, checkpoint,
fork, hibernate/resume and restore."""

from __future__ import annotations

import subprocess
import time

import pytest
from counting import COUNTER, assert_counting, log_lines
from waiting import wait_until

from k3sys.sandbox import DriverError, Runtime, Sandbox
from k3sys.sandbox.runtime.checkpoints import CheckpointService
from k3sys.sandbox.runtime.recovery import Recovery

pytestmark = pytest.mark.timeout(240)

def test_counter_survives_every_operation(sbx):
    sbx.commands.run(COUNTER)
    n = assert_counting(sbx)[-1]

    sbx.pause()
    sbx.resume()
    n = assert_counting(sbx, n)[-1]

    ck = sbx.checkpoint()
    at_ck = n
    n = assert_counting(sbx, n)[-1]

    kids = sbx.fork(2)
    try:
        for k in kids:
            assert_counting(k, n)
        # Forks run independently: each continues its own copy of the counter.
        k0 = kids[0]
        pid = k0.commands.run("cat /tmp/counter.pid").stdout.strip()
        assert k0.commands.run(f"kill {pid}").exit_code == 0
        # Gone (or a zombie): its log is final, asked of the process, not watched for a while.
        alive = f"grep -qv ') Z ' /proc/{pid}/stat 2>/dev/null && echo alive || echo gone"  # run raises on exit 1
        wait_until(lambda: k0.commands.run(alive).stdout == "gone\n", 10, "the killed counter ending")
        stopped = log_lines(k0)[-1]
        assert_counting(kids[1], stopped)
        n = assert_counting(sbx, n)[-1]
    finally:
        for k in kids:
            k.kill()

    sbx.hibernate()
    sbx.resume()
    n = assert_counting(sbx, n)[-1]

    with Sandbox.restore(ck) as old:
        got = assert_counting(old)
        # The restored copy starts from the checkpoint, not from the source's present.
        assert got[0] == 1 and at_ck <= got[-1]


SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7000))
s.listen()
open("/tmp/server-ready", "w").close()
conn, _ = s.accept()
f = conn.makefile("rw")
total = 0
for line in f:
    total += int(line)
    f.write(f"{total}\\n")
    f.flush()
"""

# Holds one TCP connection open for its whole life; takes requests through files.
CLIENT = """
import os, socket, time
c = socket.create_connection(("127.0.0.1", 7000))
f = c.makefile("rw")
n = 0
while True:
    try:
        data = open("/tmp/req").read()
    except FileNotFoundError:
        data = ""
    if not data.strip():  # absent, or caught between the host's create and write
        time.sleep(0.005)
        continue
    os.unlink("/tmp/req")
    n += 1
    f.write(data.strip() + "\\n")
    f.flush()
    reply = f.readline().strip()
    with open("/tmp/resp.tmp", "w") as out:
        out.write(f"{n} {reply}")
    os.rename("/tmp/resp.tmp", "/tmp/resp")
"""


def ask(s: Sandbox, k: int) -> tuple[int, int]:
    """Send `k` over the client's long-lived connection; (requests so far, server's running total)."""
    if s.files.exists("/tmp/resp"):
        s.files.remove("/tmp/resp")
    s.files.write("/tmp/req", str(k))
    wait_until(lambda: s.files.exists("/tmp/resp"), 10, "a reply over the loopback connection")
    reply = s.files.read_text("/tmp/resp").split()
    assert len(reply) == 2, f"connection broken: reply {reply!r}"
    return int(reply[0]), int(reply[1])


@pytest.mark.slow
def test_python_processes_keep_memory_and_tcp_connection(rt, debian):
    with Sandbox.create("debian", runtime=rt, memory_mb=512) as s:
        s.files.write("/srv/server.py", SERVER)
        s.files.write("/srv/client.py", CLIENT)
        s.commands.run("python3 /srv/server.py >/dev/null 2>&1 &")
        wait_until(lambda: s.files.exists("/tmp/server-ready"), 10, "the server listening")
        s.commands.run("python3 /srv/client.py >/dev/null 2>&1 &")
        assert ask(s, 5) == (1, 5)
        established = s.commands.run("awk '$4 == \"01\"' /proc/net/tcp | wc -l").stdout
        assert int(established) == 2  # both ends of the one connection

        ck = s.checkpoint()
        assert ask(s, 10) == (2, 15)

        s.pause()
        s.resume()
        assert ask(s, 1) == (3, 16)

        (kid,) = s.fork(1)
        try:
            assert ask(kid, 100) == (4, 116)
            assert ask(s, 2) == (4, 18)  # the source did not see the fork's request
        finally:
            kid.kill()

        s.hibernate()
        assert s.memory_bytes() == 0
        s.resume()
        assert ask(s, 3) == (5, 21)

        with Sandbox.restore(ck) as old:
            assert ask(old, 7) == (2, 12)


def test_a_shell_that_vforks_all_the_time_checkpoints_every_time(rt, debian):
    """dash vforks every command, and the parent waits in D state until its child execs: a dump that
    catches that instant fails after CRIU's 10 s timeout ("Unseizable non-zombie ... state D"; about
    1 in 8 dumps did with one such loop). With three loops, 20 checkpoints of the sandbox running
    and paused all succeed, fast."""
    with Sandbox.create("debian", runtime=rt) as s:
        loop = "sh -c 'while :; do /bin/true; done' </dev/null >/dev/null 2>&1 &"
        s.commands.run(f"{loop} {loop} {loop} echo $! > /tmp/loop.pid")
        pid = s.files.read_text("/tmp/loop.pid").strip()
        for i in range(20):
            if i % 2:
                s.pause()
            t0 = time.perf_counter()
            s.checkpoint()
            # Under CRIU's 10 s seize timeout (the failure's mark), not a quiet machine's figure.
            assert time.perf_counter() - t0 < 9, f"checkpoint {i} took {time.perf_counter() - t0:.1f} s"
            if i % 2:
                s.resume()
        assert s.commands.run(f"kill -0 {pid}").exit_code == 0  # the loop runs on


@pytest.mark.embedded
def test_failed_dump_leaves_the_sandbox_as_it_was(private_root, tmp_path, monkeypatch):
    """A CRIU failure in checkpoint, hibernate or fork (here: its image directory fills up) raises
    DriverError with runc's and CRIU's own error lines, and the sandbox runs on as before: same
    state, processes and counter, no checkpoint, child or staging left; with room again, the same
    operations work."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "k3sys-test", str(scratch)], check=True)
    monkeypatch.setenv("K3SYS_SCRATCH", str(scratch))
    try:
        with Runtime(private_root) as rt:
            sbx = Sandbox.create(runtime=rt)
            sbx.commands.run(COUNTER)
            n = assert_counting(sbx)[-1]
            for op in (sbx.checkpoint, sbx.hibernate, lambda: sbx.fork(2)):
                with pytest.raises(DriverError, match=r"(?s)runc checkpoint failed.*Error \(criu/.*No space left"):
                    op()
                assert sbx.state == "running" and [s.id for s in Sandbox.list(runtime=rt)] == [sbx.id]
                n = assert_counting(sbx, n)[-1]
            assert rt.checkpoints() == [] and list(rt.scratch.iterdir()) == []
            subprocess.run(["mount", "-o", "remount,size=256m", str(scratch)], check=True)
            ck = sbx.checkpoint()
            assert sbx.info.head == ck.id
            sbx.hibernate()
            sbx.resume()
            assert_counting(sbx, n)
            rt.kill_all()
    finally:
        subprocess.run(["umount", str(scratch)], check=True)


@pytest.mark.embedded
def test_fork_whose_child_fails_leaves_no_child_and_no_checkpoint(private_root, monkeypatch):
    """One of three children fails to restore: the fork raises, the children that did start are
    gone, nothing is stored, the fork's layer is collected, and the source runs on as before."""
    spawn, calls = CheckpointService.spawn, []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise DriverError("injected: restore failed")
        return spawn(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointService, "spawn", flaky)
    with Runtime(private_root) as rt:
        sbx = Sandbox.create(runtime=rt)
        sbx.commands.run(COUNTER)
        n = assert_counting(sbx)[-1]
        with pytest.raises(DriverError, match="injected"):
            sbx.fork(3)
        assert len(calls) == 3
        assert [s.id for s in Sandbox.list(runtime=rt)] == [sbx.id] and sbx.state == "running"
        assert rt.checkpoints() == [] and sbx.info.head is None
        assert list((private_root / "layers").iterdir()) == []
        assert_counting(sbx, n)
        rt.kill_all()


@pytest.mark.embedded
def test_reaper_outlives_an_unexpected_error(private_root, monkeypatch):
    """An error that is not a SandboxError (say, a full disk under the store) while applying one
    sandbox's timeout must not stop the reaper: later timeouts are still applied."""
    expire, calls = Recovery.expire, []

    def failing_once(self, sid):
        calls.append(sid)
        if len(calls) == 1:
            raise OSError(28, "No space left on device (injected)")
        return expire(self, sid)

    monkeypatch.setattr(Recovery, "expire", failing_once)
    with Runtime(private_root, on_timeout="kill") as rt:
        s = Sandbox.create(runtime=rt, timeout_s=1)
        wait_until(lambda: s not in Sandbox.list(runtime=rt), 20, "the retried expiry killing the sandbox", step=0.1)
        assert len(calls) >= 2
        rt.kill_all()
