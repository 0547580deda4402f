"""PID 1 (the agent) stopped from inside (issue 30, item 8): root inside once PTRACE_ATTACHed to it
and, the tracer gone, left it stopped; every call to that sandbox hung, a kill after a pause hung,
and so did the server's shutdown.

Now the agent is not dumpable, so the attach fails (EPERM) in every kind of sandbox and in a fork.
And an agent that stops answering anyway (simulated from the host: SIGSTOP of its host pid) fails
each call within its deadline with AgentTimeoutError naming the sandbox; a kill completes at once
and leaves nothing; a real server with such a sandbox exits on SIGTERM within its bound.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Arena
from sandbox_fixtures import leftovers
from service_process import ServiceProcess
from waiting import wait_until

from k3sys.sandbox import Sandbox
from k3sys.sandbox.errors import AgentError, AgentTimeoutError
from k3sys.sandbox.runtime.agent import SOCKET, Deadlines
from k3sys.sandbox.runtime.agent_link import ANSWER_ENV

pytestmark = pytest.mark.timeout(240)
FAST = Deadlines(answer=3.0, probe=2.0)  # seconds: a stuck agent fails a call within probe + answer
SLACK = 10.0  # seconds beyond a deadline that a loaded machine may add to a failing call

# Python inside a debian sandbox: PTRACE_ATTACH (16) to PID 1, process_vm_writev into it and
# /proc/1/mem opened for writing; prints the errno of each (0: it worked).
_ATTACK = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
r = libc.ptrace(16, 1, 0, 0)
attach = 0 if r == 0 else ctypes.get_errno()
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8)
local, remote = iovec(ctypes.addressof(buf), 8), iovec(0x400000, 8)
r = libc.process_vm_writev(1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
vm = 0 if r >= 0 else ctypes.get_errno()
try:
    os.close(os.open("/proc/1/mem", os.O_RDWR))
    mem = 0
except OSError as e:
    mem = e.errno
print(attach, vm, mem)
"""


def _state(pid: int) -> str:
    """A host process's state letter (T: stopped, t: stopped by a tracer)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _attack(s: Sandbox) -> tuple[int, int, int]:
    s.files.write("/tmp/attack.py", _ATTACK)
    r = s.commands.run("python3 /tmp/attack.py", timeout=60)
    assert r.exit_code == 0, r.stderr
    return tuple(int(x) for x in r.stdout.split())  # type: ignore[return-value]


@pytest.mark.parametrize("network", [False, True], ids=["hardened", "network"])
def test_ptrace_of_pid1_from_inside_is_refused(arena, sec_rt, debian_template, network, record_property):
    kind = "network=True" if network else "hardened"
    record_property("attack", f"PTRACE_ATTACH / process_vm_writev / /proc/1/mem on PID 1 ({kind}, and in a fork)")
    s = arena.create(template="debian", memory_mb=128, network=network)
    kid = s.fork(1)[0]
    # A restored agent is dumped again (CRIU's user namespace check opens its namespaces with
    # CRIU's own credentials: scripts/sandbox/patches/criu-4.1-7-*), and its fork is protected too.
    grandkid = kid.fork(1)[0]
    arena.track([kid, grandkid])
    for box in (s, kid, grandkid):
        assert _attack(box) == (1, 1, 13), "EPERM, EPERM, EACCES"
        pid = sec_rt.driver.init_pid(box.id)
        assert _state(pid) not in "tT", "PID 1 left stopped"
        assert box.commands.run("echo alive", timeout=30).stdout == "alive\n"
    # A user's own processes stay traceable by their user (debuggers inside keep working).
    r = s.commands.run("sleep 30 >/dev/null 2>&1 & python3 -c \"import ctypes,sys;l=ctypes.CDLL(None,use_errno=True);"
                       "print(l.ptrace(16,int(sys.argv[1]),0,0), ctypes.get_errno())\" $!", timeout=60)
    assert r.stdout.split()[0] == "0", r.stdout
    record_property("figure", f"{kind}: attach, process_vm_writev EPERM, /proc/1/mem EACCES (source, fork, "
                              "fork of the fork); a user's own process still traceable")


@pytest.fixture(scope="module")
def fast_rt(tmp_path_factory) -> Iterator:
    """A runtime whose agent deadlines are short (FAST), so stuck-agent tests take seconds."""
    from k3sys.sandbox import Runtime
    from k3sys.sandbox.runtime.drivers.runc import RuncDriver

    root = (tmp_path_factory.mktemp("pid1") / "rt").resolve()
    root.mkdir()
    runtime = Runtime(root, driver=RuncDriver(root, deadlines=FAST), on_timeout="hibernate")
    yield runtime
    ids = {i.id for i in runtime.list()}
    runtime.kill_all()
    runtime.close()
    assert leftovers(runtime.root, ids) == []


@pytest.fixture
def fast_arena(fast_rt, host, bystander) -> Iterator[Arena]:
    a = Arena(fast_rt, host, bystander)
    yield a
    a.finish()


def _stop_agent(rt, s: Sandbox) -> int:
    """SIGSTOP the sandbox's agent from the host (what the attach did); returns its host pid."""
    pid = rt.driver.init_pid(s.id)
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: _state(pid) == "T", 10, "the agent stopped")
    return pid


def _fill_backlog(path: Path) -> list[socket.socket]:
    """Connections queued on a stopped agent's socket `path` until its backlog is full (after which
    a connect waits: the hang that held a pause, and the kill or shutdown behind it, for good)."""
    held = []
    d = os.open(path.parent, os.O_PATH)  # a short name for a path past AF_UNIX's 108 bytes
    try:
        while len(held) < 1000:
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(f"/proc/self/fd/{d}/{path.name}")
            except BlockingIOError:
                c.close()
                return held
            held.append(c)
    finally:
        os.close(d)
    raise AssertionError("the agent's backlog never filled")


def _fails_in_time(call, limit: float, sid: str) -> float:
    t0 = time.monotonic()
    with pytest.raises(AgentTimeoutError, match=sid):
        call()
    took = time.monotonic() - t0
    assert took < limit + SLACK, f"failed after {took:.1f} s, its deadline is {limit} s"
    return took


def test_stuck_agent_fails_calls_within_deadlines_and_kill_completes(fast_arena, fast_rt, record_property):
    record_property("attack", "PID 1 stopped (SIGSTOP from the host): command, pause, checkpoint, kill")
    rt = fast_rt
    s = fast_arena.create(memory_mb=64)
    s.files.write("/root/data", "kept")
    ck = s.checkpoint()
    _stop_agent(rt, s)
    t_run = _fails_in_time(lambda: s.commands.run("echo hi", timeout=120), FAST.probe + FAST.answer, s.id)
    t_file = _fails_in_time(lambda: s.files.read("/root/data"), FAST.answer + 5, s.id)
    held = _fill_backlog(rt.table.dirs(s.id).rootfs / SOCKET)
    try:
        t_pause = _fails_in_time(lambda: rt.pause(s.id, hibernate=True), FAST.answer, s.id)
        t_ck = _fails_in_time(lambda: rt.checkpoint(s.id), FAST.answer, s.id)
        t_hib = _fails_in_time(lambda: rt.hibernate(s.id), FAST.answer, s.id)
    finally:
        for c in held:
            c.close()
    assert rt.info(s.id).state == "running"  # each failure left it as it was
    assert [c.id for c in rt.checkpoints() if c.sandbox_id == s.id] == [ck.id]
    # A kill while a checkpoint waits on the stuck agent: it cuts the wait instead of queueing behind it.
    errors: list[BaseException] = []

    def checkpoint() -> None:
        try:
            rt.checkpoint(s.id)
        except BaseException as e:  # noqa: BLE001 - collected for the assert
            errors.append(e)

    t = threading.Thread(target=checkpoint)
    t.start()
    wait_until(lambda: rt.info(s.id).state == "checkpointing", 10, "the checkpoint under way")
    t0 = time.monotonic()
    s.kill()
    t_kill = time.monotonic() - t0
    t.join(30)
    # Cut by the kill (not left to its deadline): the kill waited for nothing of the agent's.
    assert errors and isinstance(errors[0], AgentError) and "killed" in str(errors[0]), errors
    assert t_kill < FAST.answer + SLACK
    # The checkpoint taken before is whole: a restore of it runs.
    with Sandbox.restore(ck.id, runtime=rt) as back:
        assert back.files.read_text("/root/data") == "kept"
    record_property("figure", f"AgentTimeoutError naming the sandbox: run {t_run:.1f} s, read {t_file:.1f} s, "
                              f"pause {t_pause:.1f} s, checkpoint {t_ck:.1f} s, hibernate {t_hib:.1f} s "
                              f"(backlog full); kill during a checkpoint {t_kill:.2f} s, nothing left")


def test_silent_command_outlives_its_probes(fast_arena, record_property):
    """A command that prints nothing for several probe intervals is not taken for a stuck agent."""
    record_property("attack", "a silent command mistaken for a stuck agent")
    s = fast_arena.create(memory_mb=64)
    quiet = FAST.probe * 3
    r = s.commands.run(f"sleep {quiet:g}; echo done", timeout=120)
    assert r.stdout == "done\n"
    record_property("figure", f"{quiet:g} s silent ({quiet / FAST.probe:g} probe intervals): ran to its end")


def test_stuck_sandbox_past_its_timeout_is_killed_and_logged(fast_arena, fast_rt, caplog, record_property):
    record_property("attack", "PID 1 stopped when its timeout_s runs out")
    s = fast_arena.create(memory_mb=64, timeout_s=600)
    _stop_agent(fast_rt, s)
    with caplog.at_level(logging.INFO, logger="k3sys.sandbox.runtime.recovery"):
        fast_rt.set_timeout(s.id, 0)
        wait_until(lambda: s.id not in {i.id for i in fast_rt.list()}, FAST.answer + SLACK,
                   "the stuck sandbox killed past its timeout", step=0.05)
    lines = [r.getMessage() for r in caplog.records if s.id in r.getMessage()]
    assert any("hibernation failed" in m and "AgentTimeoutError" in m and "killed" in m for m in lines), lines
    record_property("figure", "hibernation fails (AgentTimeoutError), sandbox killed, one warning line")


def _init_pid(root: Path, sid: str) -> int:
    return int(json.loads((root / "runc" / sid / "state.json").read_text())["init_process_pid"])


def _kill_left(root: Path, ids: set[str]) -> None:
    """Kill what a stopped service left on `root` (a runtime adopting it) and check nothing stays."""
    from k3sys.sandbox import Runtime

    with Runtime(root) as rt:
        rt.kill_all()
    assert [x for x in leftovers(root, ids) if not x.startswith("sandbox dir")] == []


@pytest.mark.timeout(300)
def test_server_with_a_stuck_sandbox_exits_on_sigterm(tmp_path, host, bystander, record_property):
    record_property("attack", "PID 1 stopped, then the server stopped (SIGTERM)")
    root = tmp_path / "svc"
    answer = 3.0
    bound = 10 + answer + SLACK  # uvicorn's grace for connections + one failed hibernation
    svc = ServiceProcess(root, env={ANSWER_ENV: str(answer)}).start()
    held: list[socket.socket] = []
    try:
        with svc.client() as client:
            stuck = Sandbox.create(runtime=client, memory_mb=64, id="stuck")
            other = Sandbox.create(runtime=client, memory_mb=64, id="other")
            os.kill(_init_pid(root, "stuck"), signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(AgentTimeoutError, match="stuck"):  # typed across the wire (504)
                stuck.commands.run("echo hi", timeout=120)
            t_run = time.monotonic() - t0
            assert other.commands.run("echo fine").stdout == "fine\n"
        held = _fill_backlog(root / "sandboxes" / "stuck" / "bundle" / "rootfs" / SOCKET)
        t0 = time.monotonic()
        svc.stop(signal.SIGTERM, timeout=bound + 60)
        took = time.monotonic() - t0
        assert took < bound, f"exited {took:.1f} s after SIGTERM (bound {bound} s)"
        log = svc.log_tail(20000)
        assert "stuck" in log and "AgentTimeoutError" in log, log  # its failed hibernation is logged
        from k3sys.sandbox import Runtime

        with Runtime(root) as rt:  # the stuck one left running (adopted), the other hibernated
            assert {i.id: i.state for i in rt.list()} == {"stuck": "running", "other": "hibernated"}
    finally:
        svc.stop(signal.SIGKILL)
        for c in held:
            c.close()
        _kill_left(root, {"stuck", "other"})
    assert host.unchanged()
    assert bystander.commands.run("cat /root/mine").stdout == "bystander"
    record_property("figure", f"run fails in {t_run:.1f} s (504 agent_timeout); SIGTERM exit in {took:.1f} s "
                              f"(bound {bound:g} s, backlog full); stuck sandbox logged and adopted, nothing leaked")


@pytest.mark.timeout(120)
def test_shutdown_gives_up_after_shutdown_s(tmp_path, record_property):
    """A stop whose on_shutdown outlasts --shutdown-timeout exits at it, saying what it left."""
    record_property("attack", "server stop with a hibernation that outlasts --shutdown-timeout")
    root = tmp_path / "svc"
    # Default agent deadlines (30 s): the stuck sandbox's hibernation outlasts a 2 s shutdown bound.
    svc = ServiceProcess(root, "--shutdown-timeout", "2").start()
    try:
        with svc.client() as client:
            Sandbox.create(runtime=client, memory_mb=64, id="stuck")
        os.kill(_init_pid(root, "stuck"), signal.SIGSTOP)
        t0 = time.monotonic()
        svc.stop(signal.SIGTERM, timeout=60)
        took = time.monotonic() - t0
        assert took < 10 + 2 + SLACK, took
        assert "not done within shutdown_s=2 s" in svc.log_tail(20000)
    finally:
        svc.stop(signal.SIGKILL)
        _kill_left(root, {"stuck"})
    record_property("figure", f"SIGTERM exit in {took:.1f} s with --shutdown-timeout 2 (hibernation left)")
