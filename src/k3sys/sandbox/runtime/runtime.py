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

Parts (docs/sandbox.md draws who calls whom): the sandbox table (table.py: records, per-sandbox
locks, the one transition table, `transition`) and the sealed layers (layerset.py: a reference count
per layer, the last release deletes) are parts of their own, constructed here with their
dependencies and reached as `self.table` and `self.layers`. Commands (commands.py), files
(files.py), checkpoints (checkpoints.py: checkpoint, hibernate, restore, fork; prefetch.py; sealed.py
what a sealed layer holds of the disk) and recovery (recovery.py: startup recovery, the timeout
reaper) are still mixins of this class over base.py; this module holds construction, create / kill
/ pause / resume and the queries.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3sys.sandbox.errors import (
    AgentError,
    AgentTimeoutError,
    DriverError,
    InvalidArgumentError,
    NotFoundError,
    RuntimeLockedError,
    SandboxError,
)
from k3sys.sandbox.runtime.background import Cancelled, Hibernator, Job
from k3sys.sandbox.runtime.checkpoints import Checkpoints
from k3sys.sandbox.runtime.commands import Commands
from k3sys.sandbox.runtime.drivers.base import Driver
from k3sys.sandbox.runtime.files import Files
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.recovery import Recovery
from k3sys.sandbox.runtime.state import Record, State
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.templates import template_rootfs
from k3sys.sandbox.runtime.trees import remove_tree
from k3sys.sandbox.runtime.watch import WatchBudget
from k3sys.sandbox.spec import ON_TIMEOUT, SandboxSpec, check_number
from k3sys.sandbox.types import SandboxInfo

_log = logging.getLogger(__name__)
# Seconds between E2B's pause (a freeze) and the start of its background hibernation: a connect
# within this is a thaw in milliseconds; after it, it waits for the CRIU dump in progress (~2 s/GiB).
HIBERNATE_DELAY_S = 1.0
DUMP_TRIES = 3  # a background hibernation's dump is tried this often (`_hibernate_tries`)


def default_root() -> Path:
    """`K3SYS_HOME`, else `~/.local/share/k3sys`."""
    env = os.environ.get("K3SYS_HOME")
    return Path(env) if env else Path.home() / ".local" / "share" / "k3sys"


class Runtime(Recovery, Checkpoints, Files, Commands):
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
        self._mu = threading.Lock()  # guards `_commands` and `_staged`
        self._commands = {}  # command id -> its sandbox and pid (commands.py)
        self._staged = {}  # sandbox id -> images prefetched for its resume (prefetch.py)
        self._watches = WatchBudget()  # watches open per sandbox (watch.py)
        # Image directories are deleted off the caller's path (freeing 64 MiB of tmpfs takes ~5 ms).
        self._cleaner = ThreadPoolExecutor(1, thread_name_prefix="k3sys-sandbox-cleanup")
        self._closed = threading.Event()
        self._hibernator = Hibernator(self._hibernate_job, hibernate_workers, hibernate_delay_s)
        self._recover()
        self._reaper = threading.Thread(target=self._reap_expired, name="k3sys-sandbox-reaper", daemon=True)
        self._reaper.start()

    def create(self, spec: SandboxSpec, id: str | None = None) -> SandboxInfo:
        """Start a new sandbox from `spec.template`; `id` chosen by the caller or generated."""
        if not isinstance(spec, SandboxSpec):
            raise InvalidArgumentError(f"spec: expected a SandboxSpec, got {type(spec).__name__}")
        template_rootfs(spec.template)  # unknown template -> UnknownTemplateError before any work
        sid = self.table.claim_id(id)
        now = time.time()
        rec = Record(sid, spec, State.CREATING, now, deadline=now + spec.timeout_s if spec.timeout_s else None)
        self.table.register(rec)
        with self.table.locked(sid):
            self.table.save(rec)
            try:
                self.driver.create(sid, self.table.dirs(sid), spec, self._lowers(rec))
            except BaseException:
                self._discard(rec)
                raise
            self.table.set(rec, State.RUNNING)
            return self.table.info(rec)

    def _discard(self, rec: Record) -> None:
        """Release everything of `rec` and forget it (its checkpoints stay in the store)."""
        dirs = self.table.dirs(rec.id)
        self.driver.drop_agent(rec.id)  # calls waiting on it fail now; commands die with the sandbox
        try:
            self.driver.destroy(rec.id, dirs)
        except BaseException as e:
            # Something is still held (a mount, a cgroup): keep the record so it stays visible.
            self.table.set(rec, State.LOST, reason=f"kill failed: {e}")
            raise
        remove_tree(dirs.root)
        self._unstage(rec.id)
        self.table.drop(rec)
        self._drop_own(rec.hibernation)

    def kill(self, sid: str) -> None:
        """Stop the sandbox and release its processes, memory, mounts, cgroups and files (a
        background hibernation in flight stops after its current phase first)."""
        self._hibernator.cancel(sid)
        if self.table.get(sid) is not None:
            # Calls on its agent end now, and fail from here on, those of an operation holding the
            # lock included (a dump's quiesce of a stuck agent): the kill waits for none of their deadlines.
            self.driver.agent(sid, self.table.dirs(sid)).cut("the sandbox is being killed")
        with self.table.locked(sid) as rec:
            self._discard(rec)

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

    def memory_bytes(self, sid: str) -> int:
        """Memory the sandbox's processes hold now, in bytes (0 unless running or paused)."""
        return self.driver.memory_bytes(sid)

    def cpu_seconds(self, sid: str) -> float:
        """CPU seconds the sandbox's cgroup has charged (0 unless running or paused; the count restarts
        from 0 when a hibernated sandbox resumes, since it comes back in a new cgroup)."""
        return self.driver.cpu_seconds(sid)

    def pause(self, sid: str, hibernate: bool = False) -> None:
        """Freeze the sandbox: no CPU, memory kept; commands and files are refused until `resume`.

        `hibernate`: and hibernate it in the background (E2B's pause): this returns once it is
        frozen; a worker checkpoints and stops it `hibernate_delay_s` later, releasing its memory
        once the checkpoint is durable. Meanwhile its info says "paused" with `then_hibernate`, then
        "hibernating", then "hibernated"; a `resume` before the end is a thaw (background.py)."""
        with self.table.locked(sid) as rec:
            self.table.require(rec, "pause", State.RUNNING)
            # For a hibernation: the agent drops the host's connections and holds its gate first, so
            # the dump needs no thaw and saves exactly this state (the driver's `pause(sid, dirs)`).
            self.driver.pause(sid, self.table.dirs(sid) if hibernate else None)
            self.table.set(rec, State.PAUSED, then_hibernate=hibernate, reason="")
            if hibernate:
                self._hibernator.submit(sid)

    def _hibernate_job(self, job: Job) -> None:
        """A background worker's hibernation of `job.sid` (see `pause`)."""
        try:
            with self.table.locked(job.sid) as rec:
                if not self._hibernator.active(job) or rec.state is not State.PAUSED or not rec.then_hibernate:
                    return  # resumed, killed, or hibernated by someone else meanwhile
                try:
                    self._hibernate_tries(rec, job)
                except Cancelled:
                    pass
                except Exception as e:  # noqa: BLE001 - the sandbox stays paused; its record says why
                    _log.warning("background hibernation of %s failed: %s: %s", job.sid, type(e).__name__, e)
                    self.table.set(rec, rec.state, reason=f"background hibernation failed: {type(e).__name__}: {e}")
        except NotFoundError:
            pass  # killed before its turn

    def _hibernate_tries(self, rec: Record, job: Job | None = None) -> None:
        """`_hibernate_locked`, made again (up to DUMP_TRIES times) when the dump or the agent's
        quiesce before it fails. A sandbox the driver must thaw for that quiesce (one a restarted
        runtime adopted frozen; the pause's own freeze needs none) wakes every process whose timer ran
        out meanwhile at that instant: one exiting just as CRIU seizes it fails the dump ("Unseizable
        non-zombie"). Each failure leaves the sandbox as it was (frozen), so a second try a moment
        later, past that burst, is safe."""
        for attempt in range(1, DUMP_TRIES + 1):
            try:
                self._hibernate_locked(rec, job, internal=True)
                return
            except (DriverError, AgentError) as e:
                if isinstance(e, AgentTimeoutError):
                    raise  # a stuck agent: it did not answer for seconds, a try a moment later will not help
                if job is not None and job.cancelled:
                    raise Cancelled(f"hibernation of {rec.id} cancelled after a failed dump") from e
                if attempt == DUMP_TRIES:
                    raise
                _log.info("hibernation of %s: dump failed (try %d of %d), again: %s", rec.id, attempt, DUMP_TRIES, e)
                time.sleep(0.05 * attempt)

    def resume(self, sid: str, memory: bool = True) -> None:
        """Thaw a paused sandbox, or restore a hibernated one (same id, same processes). `memory=False`
        boots a hibernated one cold instead: its files as they were, none of its processes (E2B's
        filesystem-only resume; a sandbox still hibernating in the background finishes that first).

        A background hibernation in flight is cancelled: it stops after its current phase (the CRIU
        dump, or the store commit) and the sandbox thaws, its processes never stopped."""
        if memory:
            self._hibernator.cancel(sid)  # before the lock: its worker holds it while it works
        with self.table.locked(sid) as rec:
            self.table.require(rec, "resume", State.PAUSED, State.HIBERNATED)
            if rec.state is State.PAUSED and rec.then_hibernate and not memory:
                self._hibernator.take(sid)
                self._hibernate_tries(rec)
            if rec.state is State.PAUSED:
                self.driver.resume(sid)
                if rec.then_hibernate:  # its gate is held since the pause
                    self.driver.agent(sid, self.table.dirs(sid)).open_gate()
                self.table.set(rec, State.RUNNING, then_hibernate=False)
                return
            with self.table.transition(sid, (State.HIBERNATED,), State.RESUMING, State.RUNNING, "resume"):
                try:
                    if memory:
                        self._restore_into(rec, rec.head)
                    else:  # the sealed fs of its last checkpoint under a fresh upper, the template's PID 1
                        self.driver.create(sid, self.table.dirs(sid), rec.spec,
                                           [self.layers.ensure(rec.head), template_rootfs(rec.spec.template)],
                                           sealed_bytes=rec.sealed_bytes)
                except BaseException:  # back to hibernated (`transition`), with nothing of the attempt left
                    with contextlib.suppress(SandboxError):
                        self.driver.destroy(sid, self.table.dirs(sid))
                    self._wipe_upper(rec)
                    raise
                # A sandbox hibernated by its timeout gets a fresh `timeout_s` from now.
                deadline = rec.deadline if rec.deadline or not rec.spec.timeout_s else time.time() + rec.spec.timeout_s
                self.table.set(rec, rec.state, layer=rec.head, deadline=deadline, reason="")

    def set_timeout(self, sid: str, timeout_s: float | None) -> None:
        """The sandbox's `on_timeout` applies `timeout_s` seconds from now (None: never)."""
        if timeout_s is not None:
            check_number("timeout_s", timeout_s, 0, 1e9, "seconds (or None)")
        with self.table.locked(sid) as rec:
            self.table.set(rec, rec.state, deadline=None if timeout_s is None else time.time() + timeout_s)

    def close(self) -> None:
        """Let go of the directory; sandboxes keep running and the next runtime adopts them."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._reaper.join()
        self._hibernator.close()  # after the hibernations in flight; queued ones are the next runtime's
        for sid in list(self._staged):
            self._unstage(sid)
        self._cleaner.shutdown(wait=True)
        self.driver.close()
        with contextlib.suppress(OSError):
            self.scratch.rmdir()
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
