"""A restore's runc started before its sandbox is ready (drivers/gate.py, k3sys-criu-gate): each CRIU
run waits for the gate, a gate closed unopened fails every run, and a restore that fails before the
gate opens leaves nothing of runc behind and the sandbox resumable."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from waiting import wait_until

from k3sys.sandbox import DriverError, Sandbox
from k3sys.sandbox.runtime.drivers.gate import NAME, Gate
from k3sys.sandbox.runtime.drivers.runc import RuncDriver
from k3sys.sandbox.runtime.system import system_paths

GATE = system_paths().criu_gate
pytestmark = [pytest.mark.embedded, pytest.mark.skipif(not os.access(GATE, os.X_OK),
                                                      reason=f"{GATE} is not built (scripts/install-sandbox.sh)")]


def run(gate: Gate | None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The gate as runc runs it (`criu swrk 3`), with /bin/echo as the CRIU it execs."""
    env = {**(gate.env if gate else {}), **(env or {})}
    env.setdefault("K3SYS_CRIU", "/bin/echo")
    return subprocess.Popen([str(GATE), "swrk", "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def at_gate(pids: list[int], fifo: str) -> bool:
    """Each of `pids` has a gate's FIFO open (it waits there, reading): `fifo` itself, or any of one
    under directory `fifo`."""
    def holds(pid: int) -> bool:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            return False
        return any(x == fifo or (x.startswith(f"{fifo}/") and x.endswith(f"/{NAME}")) for x in links)
    return all(holds(p) for p in pids)


def test_each_run_waits_for_the_gate_then_is_criu(tmp_path: Path):
    gate = Gate(tmp_path, Path("/bin/echo"))
    try:
        first, second = run(gate), run(gate)
        wait_until(lambda: at_gate([first.pid, second.pid], str(gate.path)), 10, "both runs at the gate")
        assert first.poll() is None and second.poll() is None  # held
        gate.open()
        assert [p.communicate(timeout=10) for p in (first, second)] == [("swrk 3\n", "")] * 2
        assert first.returncode == second.returncode == 0
    finally:
        gate.close()
    assert not gate.path.exists()


def test_a_gate_closed_unopened_fails_every_run(tmp_path: Path):
    gate = Gate(tmp_path, Path("/bin/echo"))
    waiting = run(gate)
    wait_until(lambda: at_gate([waiting.pid], str(gate.path)), 10, "the run at the gate")
    gate.close()
    out, err = waiting.communicate(timeout=10)
    assert waiting.returncode == 1 and out == "" and "called off" in err
    late = run(None, {"K3SYS_CRIU_GATE": str(gate.path)})  # after the close: the FIFO is gone
    assert late.wait(10) == 1
    gate.close()  # idempotent


def test_without_a_gate_it_is_criu_at_once(tmp_path: Path):
    assert run(None).communicate(timeout=10) == ("swrk 3\n", "")
    unset = subprocess.run([str(GATE)], env={}, capture_output=True, text=True)
    assert unset.returncode == 1 and "K3SYS_CRIU" in unset.stderr


def test_a_restore_that_fails_before_the_gate_leaves_no_runc_behind(rt, monkeypatch):
    """The mounts fail while runc waits at the gate: runc gives up at its version check (no
    container, no cgroup), the lazy-pages daemon started beside is stopped, the sandbox stays
    hibernated, and the next resume works."""
    with Sandbox.create("base", runtime=rt) as s:
        s.commands.run("echo kept > /tmp/mark")
        s.hibernate()

        def failing(*args, **kwargs):
            # runc's CRIU at its gate (had it been later, it finds the gate gone and fails the same way).
            wait_until(lambda: [p for p in filter(str.isdigit, os.listdir("/proc")) if int(p) != os.getpid()
                                and at_gate([int(p)], str(rt.root))], 10, "runc at its gate")
            raise DriverError("the disk went away")

        monkeypatch.setattr(RuncDriver, "_mounts", failing)
        with pytest.raises(DriverError, match="the disk went away"):
            s.resume()
        monkeypatch.undo()
        assert s.info.state == "hibernated"
        assert not (rt.driver.runc_root / s.id).exists()
        assert not Path(f"/sys/fs/cgroup/memory/k3sys-{s.id}").exists()
        assert not rt.driver.lazy._daemons and not rt.driver.lazy._guards
        s.resume()
        assert s.commands.run("cat /tmp/mark").stdout == "kept\n"
