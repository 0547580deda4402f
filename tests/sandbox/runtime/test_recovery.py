"""Crash safety: a runtime killed mid-checkpoint leaves the previous checkpoint intact and the sandbox
usable; a restarted runtime adopts live sandboxes and reports dead ones as lost; nothing leaks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from counting import criu_running, wait_for
from waiting import wait_until

from k3sys.sandbox import Runtime, Sandbox

pytestmark = pytest.mark.timeout(240)
SRC = str(Path(__file__).resolve().parents[3] / "src")

# The doomed runtime: a sandbox holding ~40 MiB (so a dump takes a while), one good checkpoint,
# then checkpoints forever until the test kills it (or the store's crash hook, armed by argv[2]
# only now, ends it inside the next commit).
CHILD = textwrap.dedent("""
    import json, os, sys
    from k3sys.sandbox import Runtime, Sandbox
    rt = Runtime(sys.argv[1])
    s = Sandbox.create(runtime=rt, memory_mb=256)
    s.commands.run("sh -c 'x=$(head -c 40000000 /dev/zero | tr \\"\\\\0\\" c); i=0; "
                   "while :; do i=$((i+1)); echo $i > /tmp/n; sleep 0.02; done' >/dev/null 2>&1 &")
    s.commands.run("for i in $(seq 200); do test -s /tmp/n && exit 0; sleep 0.05; done")
    ck = s.checkpoint()
    print(json.dumps({"sandbox": s.id, "checkpoint": ck.id}), flush=True)
    if len(sys.argv) > 2:
        os.environ["K3SYS_STORE_CRASH_AT"] = sys.argv[2]
    while True:
        s.checkpoint()
""")


def start_child(root: Path, *crash_at: str) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(root), *crash_at], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": SRC})
    first = json.loads(p.stdout.readline())
    return p, first


def read_n(s: Sandbox) -> int:
    """The counter's file (retried: the loop truncates it before each write)."""
    return int(wait_until(lambda: s.files.read_text("/tmp/n").strip(), 10, "the counter's file written", step=0.005))


def check_recovered(root: Path, first: dict, leak_check) -> None:
    with Runtime(root) as rt:
        s = Sandbox.get(first["sandbox"], runtime=rt)
        assert s.state == "running"
        # Thawed and counting again.
        n = read_n(s)
        wait_for(lambda: read_n(s) > n + 2, step=0.02)
        assert s.commands.run("echo usable").stdout == "usable\n"
        # The good checkpoint is intact, the store consistent, and checkpointing works again.
        assert rt.store.verify() == []
        with Sandbox.restore(first["checkpoint"], runtime=rt) as old:
            assert read_n(old) >= 1
        ck = s.checkpoint()
        assert ck.parent is not None
        s.kill()
    assert leak_check(root, {first["sandbox"]}) == []


def test_kill_runtime_during_criu_dump(private_root, leak_check):
    root = private_root
    p, first = start_child(root)
    freezer = Path(f"/sys/fs/cgroup/freezer/k3sys-{first['sandbox']}/freezer.state")
    try:
        wait_for(lambda: criu_running(root))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # The orphaned runc + CRIU finish (or the next runtime kills them); nobody thaws the sandbox.
    wait_for(lambda: not criu_running(root))
    if freezer.exists():  # cgroup v1
        assert freezer.read_text().strip() == "FROZEN"
    check_recovered(root, first, leak_check)


def test_kill_runtime_during_store_commit(private_root, leak_check):
    # The store's own crash hook ends the process between writing the chunks and the manifest.
    root = private_root
    p, first = start_child(root, "before-manifest")
    assert p.wait(60) == 86  # the hook's exit status: it died inside the commit
    check_recovered(root, first, leak_check)


def test_restart_adopts_live_sandboxes_and_reports_lost_ones(private_root, leak_check):
    root = private_root
    with Runtime(root) as rt:
        alive = Sandbox.create(runtime=rt)
        alive.commands.run("echo before > /root/mark")
        doomed = Sandbox.create(runtime=rt)
        paused = Sandbox.create(runtime=rt)
        paused.pause()
        init = rt.driver.init_pid(doomed.id)
    os.kill(init, signal.SIGKILL)  # the sandbox dies while no runtime watches
    wait_for(lambda: not Path(f"/proc/{init}").exists(), step=0.01)
    with Runtime(root) as rt:
        states = {s.id: s.state for s in Sandbox.list(runtime=rt)}
        assert states == {alive.id: "running", doomed.id: "lost", paused.id: "paused"}
        assert "processes were gone" in rt.info(doomed.id).reason
        a = Sandbox.get(alive.id, runtime=rt)
        assert a.commands.run("cat /root/mark").stdout == "before\n"
        Sandbox.get(paused.id, runtime=rt).resume()
        rt.kill_all()
    assert leak_check(root, {alive.id, doomed.id, paused.id}) == []
