"""The runc driver: each sandbox is an OCI container run by runc and checkpointed by CRIU through runc.

Shape of a sandbox: root = overlay (sealed layer, template; own upper); own mount, pid, ipc, uts and
network namespaces (loopback only; with network=True a veth end network.py made, moved in by the
prestart hook);
cgroup limits on memory (no swap), pids and CPU. Hardened (the default; confine.py, idmap.py, disk.py):
its own user namespace on a host uid range of its own, lowers idmapped to it, a minimal capability
set, a seccomp profile, no new privileges, a writable layer of `disk_mb` on a file system of its own.
`hardened=False` keeps the older shape (host root inside), for the benchmark only.

Checkpoint and restore (runc + CRIU, the choices that keep them small and fast): criu_ops.py. Pause
and resume write the freezer cgroup directly instead of spawning runc (the same kernel operation,
minus a Go process start; cgroups.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime import layers
from k3sys.sandbox.runtime.agent import Agent, Deadlines
from k3sys.sandbox.runtime.drivers import confine, criulog, disk, idmap, inotify
from k3sys.sandbox.runtime.drivers.base import SandboxDirs
from k3sys.sandbox.runtime.drivers.cgroups import Cgroups
from k3sys.sandbox.runtime.drivers.criu_images import CriuImages
from k3sys.sandbox.runtime.drivers.criu_ops import CriuOps
from k3sys.sandbox.runtime.drivers.diskpool import DiskPool
from k3sys.sandbox.runtime.drivers.gate import Gate
from k3sys.sandbox.runtime.drivers.lazypages import UFFD_DEVICE, LazyPages
from k3sys.sandbox.runtime.drivers.network import Network
from k3sys.sandbox.runtime.drivers.reach import Reachable
from k3sys.sandbox.runtime.netns import NetnsSockets
from k3sys.sandbox.runtime.system import SystemPaths, system_paths
from k3sys.sandbox.spec import SandboxSpec

_CAPS_UNHARDENED = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_SETGID",
                    "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
                    "CAP_AUDIT_WRITE"]  # hardened=False only (the benchmark's baseline): Docker's minus NET_RAW
# Masked by runc (a file gets /dev/null, a directory an empty read-only tmpfs: runc allows nothing
# else inside /proc). /sys/firmware is masked with a bind instead, which CRIU need not archive.
_MASKED = ["/proc/acpi", "/proc/scsi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
           "/proc/timer_stats", "/proc/sched_debug"]
_MASKED_BY_BIND = ["/sys/firmware"]
_READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
_log = logging.getLogger(__name__)
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# PID 1 of every sandbox: k3sys-agent (agent/, docs/sandbox-agent.md), bind-mounted read-only. It
# drops the host-side stdio runc hands it (CRIU cannot dump host files) once its socket listens.
_AGENT = "/.k3sys/agent"
# Its output rings together hold at most this share of the sandbox's memory (and at most 64 MiB):
# processes nobody follows lose their oldest output past it, followed ones wait (agent/proc.c).
_RINGS_SHARE = 8
_RINGS_MAX = 64 << 20


class RuncDriver(CriuOps):
    """Sandboxes as runc containers under `<state_dir>/runc` (checkpoint and restore: `CriuOps`)."""

    name = "runc"

    def __init__(self, state_dir: Path, system: SystemPaths | None = None, hardened: bool = True,
                 deadlines: Deadlines | None = None) -> None:
        """`deadlines`: how long calls wait on a sandbox's agent (agent_link.py; default `Deadlines.default()`)."""
        self.system = system or system_paths()
        reason = self.system.missing()
        if reason:
            raise DriverError(reason)
        self.runc = self.system.runc
        # runc runs CRIU as `criu swrk` with no way to pass most options; CRIU reads them from the file
        # CRIU_CONFIG_FILE names, before runc's own settings. Options that must replace runc's (its
        # cgroup mode) go in a second file, named by each container's `org.criu.config` annotation,
        # which runc hands CRIU to read after its settings (see `_config`).
        self._env = {**os.environ, "CRIU_CONFIG_FILE": str(self.system.criu_config)}
        self.state_dir = state_dir.resolve()
        self.runc_root = self.state_dir / "runc"
        self._runc = [self.runc, "--root", str(self.runc_root), "--criu", str(self.system.criu)]  # global options
        self.runc_root.mkdir(parents=True, exist_ok=True)
        self.reach = Reachable(self.state_dir)  # the sandboxes' roots, reachable from their user namespaces
        self.cgroups = Cgroups()
        self.hardened = hardened
        self.ranges = idmap.Ranges()
        self._userns: dict[int, int] = {}  # range base -> descriptor of a user namespace with its mapping
        # Lazy restores (lazypages.py)
        self.lazy = LazyPages(self.system.criu, self._env, self.cgroups.kill, self.cgroups.procs_file)
        self.images = CriuImages(self.lazy)
        self._quiet: set[str] = set()  # frozen by pause(sid, dirs): dumped without a thaw (criu_ops.py)
        self.network = Network()  # network=True: own namespace, veth, NAT, egress policy (network.py)
        self.disks = DiskPool(self.state_dir / "disks")  # hardened sandboxes' disks, made ahead (diskpool.py)
        self._agents: dict[str, Agent] = {}
        self.netns = NetnsSockets()  # sockets inside sandboxes' networks, for the port proxy (netns.py)
        self.deadlines = deadlines or Deadlines.default()
        self._agents_mu = threading.Lock()
        criulog.ensure_kdat_dir()
        if (short := inotify.host_shortfall()) is not None:  # sandboxes can starve the host's root of inotify
            _log.warning("inotify limits below the sandboxes' budget: %s", short)

    # --- runc plumbing ------------------------------------------------------------------------

    def _run(self, args: list[str], log: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run `runc <args>`; DriverError with runc's message (and CRIU's log tail, if any) on failure.

        stdout and stderr are pipes read to their end. For `run -d` / `restore -d` that end comes only
        once the sandbox's PID 1, which inherits runc's stdio, has dropped it (the agent, listening):
        without that wait a checkpoint right after a create could find these host-side descriptors in
        PID 1, which CRIU cannot dump.
        """
        return self._wait(self._start(args), args, log, timeout)

    def _start(self, args: list[str], gate: Gate | None = None) -> subprocess.Popen:
        """Start `runc <args>` (`_wait` for it); with `gate`, its CRIU runs wait for the gate (gate.py)."""
        runc, env = self._runc, self._env
        if gate is not None:
            runc, env = [*runc[:-1], str(self.system.criu_gate)], {**env, **gate.env}
        return subprocess.Popen([*runc, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    def _wait(self, p: subprocess.Popen, args: list[str], log: Path | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
        """The end of runc `p` started by `_start(args)` (see `_run`)."""
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            p.kill()
            p.communicate()
            raise DriverError(f"runc {args[0]} timed out after {timeout} s") from e
        if p.returncode != 0:
            detail = (err or out).strip()
            if log is not None and log.exists():
                detail += f"\n--- {log} ---\n" + criulog.log_excerpt(log)
            raise DriverError(f"runc {args[0]} failed ({p.returncode}): {detail}")
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def _config(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, net: tuple[list[str], dict] | None,
                uffd: bool) -> dict:
        namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")]
        mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            # The agent's PTYs (runc points /dev/ptmx at this instance's ptmx); CRIU dumps devpts.
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        ] + [
            {"destination": d, "type": "bind", "source": str(self.reach.empty),
             "options": ["rbind", "ro", "nosuid", "nodev"]}
            for d in _MASKED_BY_BIND if os.path.isdir(d)
        ] + [{"destination": _AGENT, "type": "bind", "source": str(self.system.agent), "options": ["bind", "ro"]}]
        mounts += [net[1]] if net else []
        memory = spec.memory_mb << 20
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": [_AGENT, "--ring-total", str(min(_RINGS_MAX, memory // _RINGS_SHARE))],
                "env": [f"PATH={_PATH}", "HOME=/root", "LANG=C.UTF-8"],
                "cwd": "/",
                "capabilities": {k: _CAPS_UNHARDENED for k in ("bounding", "effective", "permitted")},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": confine.nofile(spec.pids),
                             "soft": min(1024, confine.nofile(spec.pids))}],
                "noNewPrivileges": True,
            },
            "root": {"path": str(self.reach.root(sid)), "readonly": False},  # dirs.rootfs, bound there
            # CRIU options that replace runc's (read after them); see scripts/install-sandbox.sh.
            "annotations": {"org.criu.config": str(dirs.bundle / "criu.conf")},
            # Constant on purpose: a fork keeps its source's UTS namespace, so an id here would lie.
            "hostname": "sandbox",
            "mounts": mounts,
            # Brings loopback up (needed after a restore, harmless after a create: runc did it) and,
            # with network=True, moves the sandbox's veth end in and sets it up (network.py).
            "hooks": {"prestart": [{"path": str(self.system.net_up),
                                    "args": [self.system.net_up.name, *(net[0] if net else [])]}]},
            "linux": {
                "resources": {
                    "devices": [{"allow": False, "access": "rwm"}] + ([UFFD_DEVICE] if uffd else []),
                    "memory": {"limit": memory, "swap": memory},
                    "pids": {"limit": spec.pids},
                    "cpu": {"quota": max(1000, int(spec.cpu * 100_000)), "period": 100_000},
                },
                "cgroupsPath": f"/k3sys-{sid}",
                "namespaces": namespaces,
                "maskedPaths": _MASKED,
                "readonlyPaths": _READONLY,
            },
        }

    def _prepare(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, lowers: list[Path],
                 sealed_bytes: int = 0) -> dict[str, float]:
        """Bundle, mounts and uid range of a sandbox about to start; seconds per step (`prepare.*`)."""
        t, uid_base = self._bundle(sid, dirs, spec, uffd=False)
        t.update(self._mounts(sid, dirs, spec, lowers, uid_base, sealed_bytes))
        return t

    def _bundle(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec,
                uffd: bool) -> tuple[dict[str, float], int | None]:
        """What runc reads before it needs the sandbox's file system: config.json and criu.conf, the
        uid range and network they name, the directory the root will be bound at. Returns seconds
        (`prepare.config`) and the range's first host id (None: no user namespace)."""
        t0 = time.perf_counter()
        dirs.bundle.mkdir(parents=True, exist_ok=True)
        dirs.logs.mkdir(parents=True, exist_ok=True)
        uid_base = self.ranges.claim(dirs.root) if self.hardened else None
        home = self.reach.make(sid, uid_base or 0)
        net = self.network.setup(dirs.root, spec.egress, home / "resolv.conf") if spec.network else None
        config = self._config(sid, dirs, spec, net, uffd)
        if self.hardened:
            confine.confine(config, uid_base)
        (dirs.bundle / "config.json").write_text(json.dumps(config))
        (dirs.bundle / "criu.conf").write_text(confine.criu_options(self.system.criu_override, spec))
        return {"prepare.config": time.perf_counter() - t0}, uid_base

    def _mounts(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, lowers: list[Path],
                uid_base: int | None, sealed_bytes: int) -> dict[str, float]:
        """The sandbox's disk (`sealed_bytes` of it reserved for its sealed layer), upper and overlay
        root, bound where runc finds it; seconds per step."""
        t, t0 = {}, time.perf_counter()
        if self.hardened:
            self.disks.create(dirs.root / "disk.img", dirs.disk, spec.disk_mb)
            disk.reserve(dirs.disk, sealed_bytes)
        for d in (dirs.upper, dirs.work, dirs.rootfs):
            d.mkdir(parents=True, exist_ok=True)
        t["prepare.disk"], t0 = time.perf_counter() - t0, time.perf_counter()
        if uid_base is not None:
            lowers = self._idmapped_lowers(dirs, [*lowers[:-1], idmap.dev_mask(self.state_dir), lowers[-1]], uid_base)
            os.chown(dirs.upper, uid_base, uid_base)  # the root directory belongs to root inside
        t["prepare.idmap"], t0 = time.perf_counter() - t0, time.perf_counter()
        # Without a user namespace runc mknods /dev in the overlay: nodev would make those nodes unusable.
        layers.mount_overlay(lowers, dirs.upper, dirs.work, dirs.rootfs, nodev=uid_base is not None)
        self.reach.add(sid, dirs.rootfs)
        t["prepare.overlay"] = time.perf_counter() - t0
        return t

    def _idmapped_lowers(self, dirs: SandboxDirs, lowers: list[Path], uid_base: int) -> list[Path]:
        with self._agents_mu:  # one user namespace per range, kept for the driver's life
            ns = self._userns.get(uid_base)
            if ns is None:
                ns = self._userns[uid_base] = idmap.userns_fd(uid_base)
        return idmap.views(dirs.bundle, lowers, ns)

    def _uid_base(self, dirs: SandboxDirs) -> int:
        """The first host id of the sandbox's range (0: it runs without a user namespace)."""
        return (self.ranges.base_of(dirs.root) or 0) if self.hardened else 0

    # --- life cycle ---------------------------------------------------------------------------

    def create(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, lowers: list[Path],
               sealed_bytes: int = 0) -> None:
        self._prepare(sid, dirs, spec, lowers, sealed_bytes)
        self._run(["run", "-d", "--bundle", str(dirs.bundle), sid])
        self._spare_agent(sid)
        self.limit_inotify(sid)  # before the gate opens: only the agent runs inside yet
        self.disks.refill()  # now that runc is done with the CPU
        self.agent(sid, dirs).open_gate()

    def close(self) -> None:
        self.disks.close()
        self.netns.close()

    def limit_inotify(self, sid: str) -> None:
        """The sandbox's inotify limits per user, in its user namespace if it has one (inotify.py)."""
        pid = self.init_pid(sid)
        if pid is None:
            raise DriverError(f"sandbox {sid} has no PID 1 to limit")
        inotify.limit(pid, self.system.inotify_limit)

    def agent(self, sid: str, dirs: SandboxDirs) -> Agent:
        """The client of the sandbox's agent, one per sandbox for its whole life (its gate spans a
        hibernation); reached through the sandbox's root."""
        with self._agents_mu:
            a = self._agents.get(sid)
            if a is None:
                a = self._agents[sid] = Agent(dirs.rootfs, pid=lambda: self.init_pid(sid), sandbox=sid,
                                              deadlines=self.deadlines, frozen=lambda: self.cgroups.frozen(sid))
            return a

    def drop_agent(self, sid: str) -> None:
        """Forget a killed sandbox's agent; calls still waiting on it fail."""
        with self._agents_mu:
            a = self._agents.pop(sid, None)
        if a is not None:
            a.cut("the sandbox was killed")

    def exec(self, sid: str, argv: list[str], cwd: str, env: dict[str, str],
             stdin: bool) -> tuple[subprocess.Popen, int]:
        pid_file = self.runc_root / f".exec-{sid}-{os.getpid()}-{time.monotonic_ns()}.pid"
        args = [*self._runc, "exec", "--pid-file", str(pid_file), "--cwd", cwd]
        for k, v in env.items():
            args += ["--env", f"{k}={v}"]
        proc = subprocess.Popen([*args, sid, *argv], stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # runc writes the pid file once the process runs; until then (or if exec fails) we have none.
        pid = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                pid = int(pid_file.read_text() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid or proc.poll() is not None:
                break
            time.sleep(0.0005)
        pid_file.unlink(missing_ok=True)
        return proc, pid

    def pause(self, sid: str, dirs: SandboxDirs | None = None) -> None:
        if dirs is None:
            self.cgroups.set_frozen(sid, True)
            return
        agent = self.agent(sid, dirs)
        agent.close_gate()  # held until the thaw or restore: no host connection enters from here on
        try:
            agent.quiesce()
            self.cgroups.freeze_for_dump(sid)
        except BaseException:
            agent.open_gate()
            raise
        self._quiet.add(sid)

    def resume(self, sid: str) -> None:
        self._quiet.discard(sid)
        self.cgroups.set_frozen(sid, False)

    def destroy(self, sid: str, dirs: SandboxDirs) -> None:
        # Kill through the cgroup and wait for the tasks to be gone before runc cleans up: runc's
        # `delete --force` alone kills too, but then retries removing the cgroups with growing sleeps
        # while the tasks exit (~150 ms here instead of a few).
        self.cgroups.kill(sid)
        self._quiet.discard(sid)
        self.lazy.stop(sid)
        if (self.runc_root / sid).exists():
            self._run(["delete", "--force", sid], timeout=60)
        self.cgroups.remove(sid)
        self.network.teardown(dirs.root)
        self.reach.drop(sid)
        layers.unmount(dirs.rootfs)
        for view in sorted(dirs.bundle.glob("lower-*")):
            layers.unmount(view)
        disk.remove(dirs.root / "disk.img", dirs.disk)
        self.ranges.release(dirs.root)

    def status(self, sid: str) -> str:
        state = self.runc_root / sid / "state.json"
        if not state.exists():
            return "missing"
        p = subprocess.run([*self._runc, "state", sid], capture_output=True, text=True)
        if p.returncode != 0:
            return "missing"
        status = json.loads(p.stdout)["status"]
        return {"running": "running", "paused": "paused", "created": "running"}.get(status, "stopped")

    def _spare_agent(self, sid: str) -> None:
        """Make the sandbox's PID 1 a process its memory limit never kills (oom_score_adj -1000), on
        top of what the agent does itself (what it starts gets 1000, agent/proc.c `child_reset`), so
        a user's process that lowers its own value still cannot make PID 1 the OOM killer's choice.
        From the host, after every start and restore: root in a user namespace may not lower it
        (that needs CAP_SYS_RESOURCE in the host's namespace), and CRIU, restoring the dumped value
        from inside, fails there and only logs it. A host without CAP_SYS_RESOURCE (some container
        hosts) leaves PID 1 at 0, protected by its children's 1000 alone."""
        pid = self.init_pid(sid)
        if pid is None:
            raise DriverError(f"sandbox {sid}: runc started no PID 1")
        try:
            Path(f"/proc/{pid}/oom_score_adj").write_text("-1000")
        except PermissionError:
            _log.debug("sandbox %s: no CAP_SYS_RESOURCE to lower PID 1's oom_score_adj", sid)

    def init_pid(self, sid: str) -> int | None:
        """Host pid of the sandbox's PID 1 (None when it has none)."""
        init = self.init_process(sid)
        return None if init is None else init[0]

    def init_process(self, sid: str) -> tuple[int, int] | None:
        """(host pid, start time in clock ticks after boot) of the sandbox's PID 1, as runc records it."""
        try:
            state = json.loads((self.runc_root / sid / "state.json").read_text())
            return int(state["init_process_pid"]), int(state["init_process_start"])
        except (OSError, ValueError, KeyError):
            return None

    def open_socket(self, sid: str, dirs: SandboxDirs, family: socket.AddressFamily) -> socket.socket:
        return self.netns.open(self.agent(sid, dirs), lambda: self.init_process(sid), family)

    def memory_bytes(self, sid: str) -> int:
        return self.cgroups.memory_bytes(sid)

    def cpu_seconds(self, sid: str) -> float:
        return self.cgroups.cpu_seconds(sid)
