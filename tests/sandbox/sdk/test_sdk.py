"""Every SDK call against real runc + CRIU sandboxes (busybox template)."""

from __future__ import annotations

import hashlib
import time

import pytest
from waiting import wait_until

import k3sys.sandbox as sandbox_pkg
from k3sys.sandbox import (
    Checkpoint,
    CommandExitError,
    CommandHandle,
    CommandResult,
    CommandTimeoutError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    Runtime,
    Sandbox,
    SandboxFileNotFoundError,
    WriteInfo,
)

pytestmark = pytest.mark.timeout(120)


def not_running(sbx: Sandbox, args: str) -> bool:
    """No process of the sandbox has `args` in its command line."""
    return args not in sbx.commands.run("ps -o args").stdout


def test_exports():
    for name in sandbox_pkg.__all__:
        assert hasattr(sandbox_pkg, name), name
    assert {"Sandbox", "Checkpoint", "SandboxError", "Runtime"} <= set(sandbox_pkg.__all__)


def test_run_returns_stdout_stderr_exit_code(sbx):
    assert sbx.commands.run("echo out; echo err >&2") == CommandResult("out\n", "err\n", 0)
    with pytest.raises(CommandExitError) as e:  # E2B's rule: a non-zero exit raises, with the result
        sbx.commands.run("echo out; echo err >&2; exit 3")
    assert (e.value.stdout, e.value.stderr, e.value.exit_code, e.value.error) == ("out\n", "err\n", 3, None)


def test_run_cwd_env_stdin(sbx):
    sbx.files.make_dir("/work/dir")
    r = sbx.commands.run('pwd; echo "$GREETING"; cat', cwd="/work/dir", env={"GREETING": "hello"}, stdin="piped")
    assert r.stdout == "/work/dir\nhello\npiped"
    assert r.exit_code == 0


def test_run_timeout_kills_the_command_tree(sbx):
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError) as e:
        sbx.commands.run("echo started; sleep 30 & sleep 30; echo never", timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert e.value.stdout == "started\n"
    # Both sleeps go (the tree's kill lands a moment after the timeout answers, over HTTP later still).
    wait_until(lambda: not_running(sbx, "sleep 30"), 10, "the timed-out tree's sleeps ending")


def test_unread_stdin_cannot_outlast_the_timeout(sbx):
    # More than a pipe holds (64 KiB), to a command that never reads it.
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError):
        sbx.commands.run("sleep 30", timeout=0.5, stdin=b"x" * (256 << 10))
    assert time.monotonic() - t0 < 10


def test_background_command_wait_output_and_kill(sbx):
    h = sbx.commands.run("echo a; sleep 0.2; echo b", background=True)
    assert isinstance(h, CommandHandle)
    r = h.wait(10)
    assert r.stdout == "a\nb\n" and r.exit_code == 0

    h = sbx.commands.run("echo begin; sleep 100", background=True)
    wait_until(lambda: h.output()[0] == "begin\n", 10, "the background command's first line")
    assert h.output() == ("begin\n", "")
    assert h.running
    assert h.kill() is True
    with pytest.raises(CommandExitError) as e:
        h.wait(10)
    assert e.value.exit_code == 128 + 9
    wait_until(lambda: not_running(sbx, "sleep 100"), 10, "the killed command's sleep ending")


def test_background_wait_timeout(sbx):
    h = sbx.commands.run("sleep 100", background=True)
    with pytest.raises(CommandTimeoutError):
        h.wait(0.3)
    wait_until(lambda: not_running(sbx, "sleep 100"), 10, "the timed-out command's sleep ending")


def test_files_round_trip(sbx):
    payload = bytes(range(256)) * 1000
    assert sbx.files.write("/data/nested/blob.bin", payload) == WriteInfo("blob.bin", "file", "/data/nested/blob.bin")
    assert sbx.files.read("/data/nested/blob.bin", format="bytes") == payload
    # The sandbox's processes see the same bytes.
    assert sbx.commands.run("md5sum /data/nested/blob.bin").stdout.split()[0] == hashlib.md5(payload).hexdigest()
    sbx.commands.run("echo from-inside > /data/inside.txt")
    assert sbx.files.read_text("/data/inside.txt") == "from-inside\n"
    names = {(e.name, e.type) for e in sbx.files.list("/data")}
    assert names == {("nested", "dir"), ("inside.txt", "file")}
    entry = next(e for e in sbx.files.list("/data/nested"))
    assert (entry.path, entry.size) == ("/data/nested/blob.bin", len(payload))
    assert sbx.files.exists("/data/inside.txt")
    sbx.files.remove("/data")
    assert not sbx.files.exists("/data")
    with pytest.raises(SandboxFileNotFoundError):
        sbx.files.read("/data/inside.txt")
    with pytest.raises(CommandExitError):
        sbx.commands.run("test -e /data")


def test_reading_a_file_that_grows_meanwhile(sbx):
    """A log being appended to while it is read (over HTTP: streamed with the size it had when
    opened) reads whole and unbroken every time."""
    head = b"x" * (4 << 20)
    sbx.files.write("/tmp/grow", head)
    h = sbx.commands.run("while :; do echo more >> /tmp/grow; done", background=True)
    try:
        for _ in range(5):
            got = sbx.files.read("/tmp/grow", format="bytes")
            assert got.startswith(head) and set(got[len(head):].split()) <= {b"more"}
    finally:
        h.kill()


def test_pause_refuses_commands_and_files_then_resume(sbx):
    sbx.pause()
    assert sbx.state == "paused"
    with pytest.raises(InvalidStateError, match="paused"):
        sbx.commands.run("true")
    with pytest.raises(InvalidStateError, match="paused"):
        sbx.files.read("/etc/passwd")
    with pytest.raises(InvalidStateError):
        sbx.pause()
    sbx.resume()
    assert sbx.state == "running"
    assert sbx.commands.run("echo back").stdout == "back\n"


def test_pause_with_hibernate_thaws_early_and_restores_late(sbx):
    # E2B's pause, embedded and remote (the service's `POST /sandboxes/{id}/pause`).
    sbx.commands.run("echo kept > /root/mark")
    sbx.pause(hibernate=True)
    info = sbx.info
    assert info.state in ("paused", "hibernating") and info.then_hibernate
    with pytest.raises(InvalidStateError):
        sbx.pause(hibernate=True)
    sbx.resume()  # within the runtime's delay: a thaw
    assert (sbx.state, sbx.info.then_hibernate) == ("running", False)
    sbx.pause(hibernate=True)
    wait_until(lambda: sbx.state == "hibernated", 60, "the delayed hibernation")
    assert sbx.info.head is not None and not sbx.info.then_hibernate
    sbx.resume()  # a restore
    assert sbx.commands.run("cat /root/mark").stdout == "kept\n"


@pytest.mark.embedded
def test_paused_sandbox_gets_no_cpu(sbx):
    # Busy counter, published by rename so a reader never sees a half-written file.
    sbx.commands.run("sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; done' "
                     ">/dev/null 2>&1 &")
    assert sbx.commands.run("for i in $(seq 200); do test -e /tmp/n && exit 0; sleep 0.05; done; exit 1").exit_code == 0
    sbx.pause()  # returns once the cgroup is frozen
    # Read the counter through the host's view of the file system: unchanged while frozen. "Nothing
    # moved" needs a window; 0.3 s is thousands of steps of a running counter, and load can only make
    # a running counter move less, never a frozen one move.
    n1 = (sbx._rt.table.dirs(sbx.id).rootfs / "tmp/n").read_text()
    time.sleep(0.3)
    n2 = (sbx._rt.table.dirs(sbx.id).rootfs / "tmp/n").read_text()
    assert n1 == n2
    sbx.resume()
    wait_until(lambda: sbx.files.read_text("/tmp/n") != n2, 10, "the resumed counter moving")


def test_checkpoint_fields_and_chain(sbx):
    ck1 = sbx.checkpoint()
    assert isinstance(ck1, Checkpoint)
    assert ck1.parent is None and ck1.sandbox_id == sbx.id and ck1.template == "busybox"
    assert 0 < ck1.bytes_new <= ck1.bytes_total
    assert sbx.state == "running"
    ck2 = sbx.checkpoint()
    assert ck2.parent == ck1.id and ck2.created >= ck1.created
    assert {ck1.id, ck2.id} <= {c.id for c in Checkpoint.list(runtime=sbx._rt)}
    assert Checkpoint.get(ck2.id, runtime=sbx._rt) == ck2
    ck1.delete()
    with pytest.raises(NotFoundError):
        Checkpoint.get(ck1.id, runtime=sbx._rt)
    ck2.delete()


def test_checkpoint_of_paused_sandbox_stays_paused(sbx):
    sbx.pause()
    ck = sbx.checkpoint()
    assert sbx.state == "paused"
    sbx.resume()
    assert sbx.commands.run("echo ok").stdout == "ok\n"
    with Sandbox.restore(ck) as other:  # restored from a frozen dump: running, not frozen
        assert other.state == "running"
        assert other.commands.run("echo ok").stdout == "ok\n"
    ck.delete()


def test_get_list_kill_and_context_manager(rt):
    with Sandbox.create(runtime=rt, id="named-sandbox") as s:
        assert Sandbox.get("named-sandbox", runtime=rt) == s
        assert s in Sandbox.list(runtime=rt)
        assert s.spec.template == "busybox" and s.spec.memory_mb == 512
        assert s.memory_bytes() > 0
    assert s not in Sandbox.list(runtime=rt)
    with pytest.raises(NotFoundError):
        Sandbox.get("named-sandbox", runtime=rt)
    with pytest.raises(NotFoundError):
        s.commands.run("true")
    assert s.kill() is False  # E2B's answer for a sandbox that is gone


def test_sandbox_timeout_kills_it(rt):
    s = Sandbox.create(runtime=rt, timeout_s=2)
    assert s.state == "running"
    wait_until(lambda: s not in Sandbox.list(runtime=rt), 10, "the sandbox's timeout killing it")


def test_hibernate_releases_memory_and_resume_restores(sbx):
    sbx.commands.run("echo kept > /root/state")
    assert sbx.memory_bytes() > 0
    ck = sbx.hibernate()
    assert sbx.state == "hibernated"
    assert sbx.memory_bytes() == 0
    assert sbx.info.head == ck.id
    with pytest.raises(InvalidStateError, match="hibernated"):
        sbx.commands.run("true")
    with pytest.raises(InvalidStateError):
        sbx.pause()
    sbx.resume()
    assert sbx.state == "running"
    assert sbx.files.read_text("/root/state") == "kept\n"
    assert sbx.commands.run("cat /root/state").stdout == "kept\n"


def test_prefetch_stages_images_for_resume(rt, sbx):
    sbx.commands.run("sh -c 'echo $$ > /tmp/pid.new && mv /tmp/pid.new /tmp/pid; exec sleep 1000' >/dev/null 2>&1 &")
    wait_until(lambda: sbx.files.exists("/tmp/pid"), 10, "the sleeper's pid file")
    pid = sbx.files.read_text("/tmp/pid")
    assert sbx.prefetch() is False  # running: nothing to stage
    with pytest.raises(InvalidArgumentError, match="ttl_s"):
        sbx.prefetch(ttl_s=0)
    sbx.hibernate()
    assert sbx.prefetch() is True and sbx.prefetch(ttl_s=30) is True  # a second call renews
    sbx.resume()
    assert sbx.state == "running" and sbx.files.read_text("/tmp/pid") == pid
    assert sbx.commands.run(f"kill -0 {pid.strip()} && echo alive").stdout == "alive\n"
    if isinstance(rt, Runtime):
        assert "store" not in rt.timings(sbx.id)  # restored from the staged images, no store read
        assert rt.prefetcher.staged(sbx.id) is None
    sbx.hibernate()
    assert sbx.prefetch(ttl_s=0.5)
    if isinstance(rt, Runtime):  # unused staged images go when their time is up
        staged = rt.prefetcher.staged(sbx.id).path
        wait_until(lambda: not staged.exists() and rt.prefetcher.staged(sbx.id) is None, 10,
                   "the unused staged images going")
    sbx.resume()  # from the store
    assert sbx.files.read_text("/tmp/pid") == pid


def test_commands_list_and_connect_in_a_fork(sbx):
    """`commands.list` shows a background command; `commands.connect(pid)` in a fork is a handle on
    the copy of that process, with the output from before the fork; the source's stays alive."""
    h = sbx.commands.run("echo before; sleep 1000", background=True)
    wait_until(lambda: h.output()[0] == "before\n", 10, "the background command's first line")
    procs = {p.pid: p for p in sbx.commands.list()}
    assert procs[h.pid].running and procs[h.pid].exit_code is None and "sleep 1000" in procs[h.pid].cmd
    (kid,) = sbx.fork(1)
    try:
        kh = kid.commands.connect(h.pid)
        assert kh.running and kh.pid == h.pid and kh.output() == ("before\n", "")
        kh.kill()
        with pytest.raises(CommandExitError, match="code 137"):
            kh.wait(10)
        assert h.running
        with pytest.raises(NotFoundError):
            kid.commands.connect(99999)
    finally:
        kid.kill()
    h.kill()
    with pytest.raises(CommandExitError, match="code 137"):
        h.wait(10)


def test_restore_and_fork_give_new_sandboxes(sbx):
    sbx.files.write("/root/f", "v1")
    ck = sbx.checkpoint()
    sbx.files.write("/root/f", "v2")
    with Sandbox.restore(ck) as r:
        assert r.id != sbx.id
        assert r.files.read_text("/root/f") == "v1"
    kids = sbx.fork(2)
    try:
        assert len({k.id for k in kids} | {sbx.id}) == 3
        assert [k.files.read_text("/root/f") for k in kids] == ["v2", "v2"]
        assert all(k.state == "running" for k in kids)
    finally:
        for k in kids:
            k.kill()
