"""The embedded sandbox runtime: ids, the state machine, persistence, checkpoints, recovery.

One `Runtime` owns one runtime directory (default `~/.local/share/k3sys`, or `K3SYS_HOME`):

    runtime.lock              flock held while a runtime has the directory open
    sandboxes/<id>/record.json  the sandbox's `Record` (state.py); bundle/, upper/, work/, logs/
    layers/<checkpoint id>/   sealed file systems in use as lower layers (read-only; counted: layerset.py)
    store/                    the content-addressed checkpoint store (`k3sys.sandbox.runtime.store`)
    runc/                     the driver's state (runc --root)
    tmp/                      staging on the same file system as layers/ (renames, hard links)

CRIU images are staged on tmpfs (`K3SYS_SCRATCH`, default /dev/shm) under `k3sys-<hash of the dir>`.

Thread safety: every life-cycle operation holds its sandbox's lock for its whole length, so two
operations on one sandbox never interleave and a caller sees each transition as atomic; a failed
one leaves the sandbox in its previous state. Operations on different sandboxes run concurrently.
Commands run without the lock (a long command does not block `pause` or `kill`).

Recovery: a runtime opening a directory another runtime left (crashed) adopts its sandboxes
(recovery.py).

`Runtime` is a facade over parts, each constructed here with the parts it calls and holding its own
state (docs/sandbox.md draws who calls whom): the sandbox table (table.py: records, per-sandbox
locks, the one transition table, `transition`), the sealed layers (layerset.py: a reference count
per layer), staging directories (staging.py), the sandboxes' agents (agents.py), the store's
checkpoints as listed (catalog.py), prefetched images (prefetch.py), releasing a sandbox
(reclaim.py), the checkpoint service (checkpoints.py: checkpoint, hibernate, restore, fork), the
life cycle (lifecycle.py: create, pause, resume, hibernate, kill; it owns the background
hibernations), creates from warm templates (warm.py: a restore of the template's checkpoint),
recovery and the reaper (recovery.py), the command and file services (commands.py with window.py,
files.py). Its public methods are theirs, bound here; it holds the directory's lock
and the queries.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import socket
from collections.abc import Callable
from pathlib import Path

from k3sys.sandbox.errors import InvalidArgumentError, NotFoundError, RuntimeLockedError
from k3sys.sandbox.runtime.agents import Agents
from k3sys.sandbox.runtime.catalog import Catalog
from k3sys.sandbox.runtime.checkpoints import CheckpointService
from k3sys.sandbox.runtime.commands import CommandService
from k3sys.sandbox.runtime.drivers.base import Driver
from k3sys.sandbox.runtime.files import FileService
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.lifecycle import Lifecycle
from k3sys.sandbox.runtime.prefetch import Prefetcher
from k3sys.sandbox.runtime.reclaim import Reclaimer
from k3sys.sandbox.runtime.recovery import Recovery
from k3sys.sandbox.runtime.staging import Staging
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.warm import WarmTemplates
from k3sys.sandbox.spec import ON_TIMEOUT, check_number
from k3sys.sandbox.types import SandboxInfo

# Seconds between E2B's pause (a freeze) and the start of its background hibernation: a connect
# within this is a thaw in milliseconds; after it, it waits for the CRIU dump in progress (~2 s/GiB).
HIBERNATE_DELAY_S = 1.0


def default_root() -> Path:
    """`K3SYS_HOME`, else `~/.local/share/k3sys`."""
    env = os.environ.get("K3SYS_HOME")
    return Path(env) if env else Path.home() / ".local" / "share" / "k3sys"


class Runtime:
    """Sandboxes of one runtime directory; see the module docstring. Use one per directory."""

    def __init__(self, root: Path | str | None = None, driver: Driver | None = None, on_timeout: str = "kill",
                 hibernate_delay_s: float = HIBERNATE_DELAY_S, hibernate_workers: int = 2) -> None:
        """`on_timeout`: what happens to a sandbox past its `timeout_s` unless its spec says ("kill",
        "hibernate"). `hibernate_delay_s`: how long after `pause(hibernate=True)` its background
        hibernation starts (a resume before then is a thaw in milliseconds); `hibernate_workers`:
        how many background hibernations run at once (background.py)."""
        if on_timeout not in ON_TIMEOUT:
            raise InvalidArgumentError(f"on_timeout: expected one of {ON_TIMEOUT}, got {on_timeout!r}")
        check_number("hibernate_delay_s", hibernate_delay_s, 0, 3600, "s")
        check_number("hibernate_workers", hibernate_workers, 1, 64, "threads", integer=True)
        self.on_timeout = on_timeout
        self.root = (Path(root) if root is not None else default_root()).resolve()
        for d in ("sandboxes", "layers", "tmp"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # Host root's alone: it holds tenants' files (live roots, sealed layers whose owners are
        # canonical, so a setuid file root wrote inside is host root's there) and checkpoints.
        self.root.chmod(0o700)
        self._lock_file = open(self.root / "runtime.lock", "a+")  # noqa: SIM115 (held for our lifetime)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeLockedError(f"runtime directory {self.root} is in use by another live process") from None
        if driver is None:
            from k3sys.sandbox.runtime.drivers.runc import RuncDriver

            driver = RuncDriver(self.root)
        self.driver = driver
        self.store = Store(self.root / "store")
        self.layers = LayerSet(self.root / "layers", self.root / "tmp",
                               lambda ck, dest: self.store.checkout(ck, {"fs": dest}))
        tag = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]
        self.scratch = Path(os.environ.get("K3SYS_SCRATCH", "/dev/shm")) / f"k3sys-{tag}"
        self.table = SandboxTable(self.root, self.layers)
        self.staging = Staging(self.root, self.scratch)
        self.agents = Agents(self.table, driver)
        self.catalog = Catalog(self.table, self.store, self.layers)
        self.prefetcher = Prefetcher(self.table, self.layers, self.store, self.staging)
        self.reclaimer = Reclaimer(self.table, driver, self.prefetcher, self.catalog)
        self.checkpoint_service = CheckpointService(self.table, self.layers, self.store, driver, self.staging,
                                                    self.prefetcher, self.catalog, self.reclaimer)
        self.lifecycle = Lifecycle(self.table, self.layers, driver, self.checkpoint_service, self.reclaimer,
                                   hibernate_delay_s, hibernate_workers)
        self.hibernator = self.lifecycle.hibernator
        self.command_service = CommandService(self.table, self.agents, driver)
        self.warm = WarmTemplates(self.lifecycle, self.checkpoint_service, self.command_service, self.catalog,
                                  self.store, self.layers)
        self.recovery = Recovery(self.root, self.table, self.layers, self.store, driver, self.staging,
                                 self.prefetcher, self.catalog, self.reclaimer, self.checkpoint_service,
                                 self.hibernator, on_timeout)
        self.file_service = FileService(self.table, self.agents)
        self._bind()
        self.recovery.recover()
        self.recovery.start()

    def _bind(self) -> None:
        """The parts' public operations as this runtime's methods (their docstrings say what each does)."""
        life, cks, cat = self.lifecycle, self.checkpoint_service, self.catalog
        self.create, self.kill, self.pause, self.resume = self.warm.create, life.kill, life.pause, life.resume
        self.hibernate, self.set_timeout = life.hibernate, life.set_timeout
        self.checkpoint, self.restore, self.fork = cks.checkpoint, cks.restore, cks.fork
        self.checkpoints, self.get_checkpoint, self.delete_checkpoint = cat.list, cat.get, cat.delete
        self.prefetch = self.prefetcher.prefetch
        cmd = self.command_service
        self.run, self.start_command, self.start_process = cmd.run, cmd.start_command, cmd.start_process
        self.start_followed, self.follow_command, self.wait_command = (cmd.start_followed, cmd.follow_command,
                                                                       cmd.wait_command)
        self.send_stdin, self.signal_process, self.resize_pty = cmd.send_stdin, cmd.signal_process, cmd.resize_pty
        self.command_exit, self.release_command, self.forget_command = (cmd.command_exit, cmd.release_command,
                                                                        cmd.forget_command)
        self.connect_command, self.processes, self.command_pid = cmd.connect_command, cmd.processes, cmd.command_pid
        self.command_output, self.read_command_output = cmd.command_output, cmd.read_command_output
        self.stream_command, self.command_running, self.kill_command = (cmd.stream_command, cmd.command_running,
                                                                        cmd.kill_command)
        fs = self.file_service
        self.read_file, self.open_file, self.write_file, self.list_dir = (fs.read_file, fs.open_file, fs.write_file,
                                                                          fs.list_dir)
        self.stat, self.move, self.remove, self.make_dir = fs.stat, fs.move, fs.remove, fs.make_dir
        self.read_stream = fs.read_stream
        self.exists, self.watch_dir = fs.exists, fs.watch_dir

    def info(self, sid: str) -> SandboxInfo:
        rec = self.table.get(sid)
        if rec is None:
            raise NotFoundError(f"no sandbox {sid!r}")
        return self.table.info(rec)

    def list(self) -> list[SandboxInfo]:
        """Every sandbox this runtime knows (killed ones are gone), oldest first."""
        return [self.table.info(r) for r in self.table.records()]

    def timings(self, sid: str) -> dict[str, float]:
        """Seconds per phase of the sandbox's latest create / checkpoint / hibernate / resume / restore /
        fork (`runc+criu`: the runc call, `criu`: CRIU's own part of it, `store`: the checkpoint store)."""
        return dict(self.table.timings.get(sid, {}))

    def open_socket(self, sid: str, family: socket.AddressFamily = socket.AF_INET
                    ) -> tuple[socket.socket, Callable[[], None]]:
        """A non-blocking TCP socket inside the sandbox's network namespace, network on or off (the
        port proxy connects it to a port there; runtime/netns.py), and the call that closes it. A
        checkpoint resets it (the peer sees a RST); while one runs, this waits."""
        if self.table.get(sid) is None:
            raise NotFoundError(f"no sandbox {sid!r}")
        dirs = self.table.dirs(sid)
        s = self.driver.open_socket(sid, dirs, family)
        return s, functools.partial(self.driver.agent(sid, dirs).release_socket, s)

    def memory_bytes(self, sid: str) -> int:
        """Memory the sandbox's processes hold now, in bytes (0 unless running or paused)."""
        return self.driver.memory_bytes(sid)

    def cpu_seconds(self, sid: str) -> float:
        """CPU seconds the sandbox's cgroup has charged (0 unless running or paused; the count restarts
        from 0 when a hibernated sandbox resumes, since it comes back in a new cgroup)."""
        return self.driver.cpu_seconds(sid)

    def close(self) -> None:
        """Let go of the directory; sandboxes keep running and the next runtime adopts them."""
        if self._lock_file.closed:
            return
        self.recovery.close()
        self.hibernator.close()  # after the hibernations in flight; queued ones are the next runtime's
        self.prefetcher.close()
        self.staging.close()
        self.driver.close()
        self._lock_file.close()

    def kill_all(self) -> None:
        """Kill every sandbox of this runtime."""
        for info in self.list():
            with contextlib.suppress(NotFoundError):
                self.kill(info.id)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
