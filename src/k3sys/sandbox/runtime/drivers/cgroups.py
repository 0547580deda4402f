"""The cgroups runc makes for a sandbox (`k3sys-<id>`, v1 hierarchies or the v2 tree): memory and
CPU charged, the freezer (pause / resume without spawning runc), and killing every task.

Why the freezer needs care on v1: a freeze can stick at FREEZING (see `Cgroups._settle_v1_freeze`);
and frozen tasks never die of SIGKILL, so `kill` thaws while it kills.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import signal
import time
from pathlib import Path

from k3sys.sandbox.errors import DriverError

_FREEZE_TRY = 0.1  # seconds one freeze attempt may take before it is undone and retried
_libc = ctypes.CDLL(None, use_errno=True)
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())
_KCMP_VM = 1


class Cgroups:
    """One host's sandbox cgroups; `v1` when the host mounts the v1 freezer hierarchy."""

    def __init__(self) -> None:
        self.v1 = Path("/sys/fs/cgroup/freezer").is_dir()

    def memory_bytes(self, sid: str) -> int:
        path = (Path(f"/sys/fs/cgroup/memory/k3sys-{sid}/memory.usage_in_bytes") if self.v1
                else Path(f"/sys/fs/cgroup/k3sys-{sid}/memory.current"))
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            return 0

    def cpu_seconds(self, sid: str) -> float:
        """CPU time the sandbox's current cgroup has charged (user + system); a new cgroup, after a
        restore, starts again from 0."""
        try:
            if self.v1:
                return int(Path(f"/sys/fs/cgroup/cpuacct/k3sys-{sid}/cpuacct.usage").read_text()) / 1e9
            stat = Path(f"/sys/fs/cgroup/k3sys-{sid}/cpu.stat").read_text().split()
            return int(stat[stat.index("usage_usec") + 1]) / 1e6
        except (OSError, ValueError):
            return 0.0

    def freezer(self, sid: str) -> Path:
        if self.v1:
            return Path(f"/sys/fs/cgroup/freezer/k3sys-{sid}/freezer.state")
        return Path(f"/sys/fs/cgroup/k3sys-{sid}/cgroup.freeze")

    def frozen(self, sid: str) -> bool:
        try:
            value = self.freezer(sid).read_text().strip()
        except OSError:
            return False
        return value in ("FROZEN", "FREEZING", "1")

    def set_frozen(self, sid: str, frozen: bool) -> None:
        path = self.freezer(sid)
        want = ("FROZEN" if frozen else "THAWED") if self.v1 else ("1" if frozen else "0")
        try:
            path.write_text(want)
            if self.v1 and frozen:
                self._settle_v1_freeze(sid, path)
            elif not self.v1:
                events = path.with_name("cgroup.events")
                deadline = time.monotonic() + 10
                while f"frozen {want}" not in events.read_text():
                    if time.monotonic() > deadline:
                        raise DriverError(f"sandbox {sid}: freezer did not settle within 10 s")
                    time.sleep(0.0002)
        except FileNotFoundError:
            raise DriverError(f"sandbox {sid}: no freezer cgroup (container not running)") from None

    def _settle_v1_freeze(self, sid: str, path: Path) -> None:
        """Wait until the v1 freezer reports FROZEN (it says FREEZING until every task stopped).

        A task can block the freeze for good: one in the middle of an execve of a multi-threaded
        program (`runc init` starting the sandbox's PID 1 or an exec'd command) waits in D state for
        its other threads to exit, and those are frozen already. So a freeze that does not settle
        within `_FREEZE_TRY` seconds is undone and tried again once the tasks had a moment to run;
        only after 10 s does it fail (thawed: the sandbox runs on as before).
        """
        deadline = time.monotonic() + 10
        while True:
            attempt = time.monotonic() + _FREEZE_TRY
            while path.read_text().strip() != "FROZEN":
                if time.monotonic() > attempt:
                    break
                time.sleep(0.0002)
                path.write_text("FROZEN")  # writing FROZEN again re-kicks tasks that were missed
            else:
                return
            stuck = _task_states(path.with_name("cgroup.procs"))
            path.write_text("THAWED")
            if time.monotonic() > deadline:
                raise DriverError(f"sandbox {sid}: processes did not freeze within 10 s: {stuck}")
            time.sleep(0.002)
            path.write_text("FROZEN")

    def freeze_for_dump(self, sid: str) -> None:
        """Freeze the sandbox at a point CRIU can dump: no process in the middle of a vfork.

        A vfork parent (dash runs every command so) waits in D state until its child execs or exits;
        CRIU seizes the child too, so it never does, and the dump fails after its 10 s timeout
        ("Unseizable non-zombie ... state D"). Such a freeze is undone and tried again once the
        child had a moment to exec; only after 10 s does it fail (thawed).
        """
        deadline = time.monotonic() + 10
        self.set_frozen(sid, True)
        while pairs := _vforks(self.freezer(sid).with_name("cgroup.procs")):
            self.set_frozen(sid, False)
            if time.monotonic() > deadline:
                raise DriverError(f"sandbox {sid}: processes stayed in vfork for 10 s (parent, child): {pairs[:5]}")
            time.sleep(0.002)
            self.set_frozen(sid, True)

    def deny_device(self, sid: str, rule: dict) -> None:
        """Take back an OCI device rule (`type`, `major`, `minor`) runc allowed the sandbox. On v1 only:
        v2's device filter is a BPF program runc attached, which leaves the rule in place."""
        path = Path(f"/sys/fs/cgroup/devices/k3sys-{sid}/devices.deny")
        if self.v1 and path.exists():
            path.write_text(f"{rule['type']} {rule['major']}:{rule['minor']} rwm")

    def procs_file(self, sid: str) -> Path:
        """The file listing the sandbox's processes (the freezer's on v1), whether or not it exists yet."""
        return Path(f"/sys/fs/cgroup/{'freezer/' if self.v1 else ''}k3sys-{sid}/cgroup.procs")

    def dirs(self, sid: str) -> list[Path]:
        base = Path("/sys/fs/cgroup")
        if self.v1:
            return [d / f"k3sys-{sid}" for d in base.iterdir() if (d / f"k3sys-{sid}").is_dir()]
        return [base / f"k3sys-{sid}"] if (base / f"k3sys-{sid}").is_dir() else []

    def kill(self, sid: str) -> None:
        """SIGKILL every task of the sandbox whatever its state (thawing it, or frozen tasks never die;
        a stopped or traced one dies of it) and wait until the cgroup is empty."""
        dirs = self.dirs(sid)
        if not dirs:
            return
        procs = dirs[0] / "cgroup.procs"
        if not self.v1:  # v2 (kernel >= 5.14): every task at once, forks racing the kill included
            with contextlib.suppress(OSError):
                (dirs[0] / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + 10
        while True:
            try:
                pids = procs.read_text().split()
            except FileNotFoundError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            if self.frozen(sid):
                with contextlib.suppress(DriverError):
                    self.set_frozen(sid, False)
            if time.monotonic() > deadline:
                raise DriverError(f"sandbox {sid}: tasks {' '.join(pids[:5])} survive SIGKILL")
            time.sleep(0.0005)

    def remove(self, sid: str) -> None:
        """Remove the cgroups runc left (none, unless its state was lost in a crash)."""
        self.kill(sid)
        for d in self.dirs(sid):
            deadline = time.monotonic() + 5
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise DriverError(f"cannot remove cgroup {d}: {e.strerror}") from e
                    time.sleep(0.005)


def _vforks(procs: Path) -> list[tuple[int, int]]:
    """(parent, child) pids of the cgroup's processes that share their parent's memory: a vfork
    (or a CLONE_VM process) not yet past its exec. Needs kcmp(2), as CRIU does; [] without it."""
    if _SYS_KCMP is None:
        return []
    try:
        pids = {int(p) for p in procs.read_text().split()}
    except (OSError, ValueError):
        return []
    out = []
    for pid in pids:
        try:  # the comm field may hold ")" and spaces: the fields after it start after the last ")"
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if ppid in pids and _libc.syscall(_SYS_KCMP, ppid, pid, _KCMP_VM, 0, 0) == 0:
            out.append((ppid, pid))
    return out


def _task_states(procs: Path) -> str:
    """`pid:state:wchan cmd` of every task listed in a cgroup's `cgroup.procs` (for error messages)."""
    out = []
    for pid in procs.read_text().split():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:60].decode(errors="replace")
        except OSError:
            continue
        out.append(f"{pid}:{state}:{wchan} {cmd.strip()}")
    return "; ".join(out)
