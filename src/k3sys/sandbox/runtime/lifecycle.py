"""A sandbox's life: create, pause (with or without a background hibernation), resume, hibernate,
kill, and its timeout. Checkpoint, restore and fork are checkpoints.py's; the background
hibernations' queue and workers are background.py's `Hibernator`, which this part owns.

Every operation holds its sandbox's lock for its whole length (table.py), so a caller sees each
transition as atomic; a failed one leaves the sandbox in its previous state.
"""

from __future__ import annotations

import contextlib
import logging
import time

from k3sys.sandbox.errors import (
    AgentError,
    AgentTimeoutError,
    DriverError,
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
)
from k3sys.sandbox.runtime.background import Cancelled, Hibernator, Job
from k3sys.sandbox.runtime.checkpoints import CheckpointService
from k3sys.sandbox.runtime.drivers.base import Driver
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.reclaim import Reclaimer
from k3sys.sandbox.runtime.state import LIVE, Record, State
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.templates import template_rootfs
from k3sys.sandbox.spec import SandboxSpec, check_number
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo

_log = logging.getLogger(__name__)
DUMP_TRIES = 3  # a background hibernation's dump is tried this often (`_hibernate_tries`)


class Lifecycle:
    """The life-cycle operations on the sandboxes of `table` (see the module docstring);
    `hibernate_delay_s` and `hibernate_workers` as `Runtime` takes them."""

    def __init__(self, table: SandboxTable, layer_set: LayerSet, driver: Driver, checkpoints: CheckpointService,
                 reclaimer: Reclaimer, hibernate_delay_s: float, hibernate_workers: int) -> None:
        self.table = table
        self.layers = layer_set
        self.driver = driver
        self.checkpoints = checkpoints
        self.reclaimer = reclaimer
        self.hibernator = Hibernator(self._hibernate_job, hibernate_workers, hibernate_delay_s)

    def create(self, spec: SandboxSpec, id: str | None = None) -> SandboxInfo:
        """Start a new sandbox from `spec.template`; `id` chosen by the caller or generated."""
        if not isinstance(spec, SandboxSpec):
            raise InvalidArgumentError(f"spec: expected a SandboxSpec, got {type(spec).__name__}")
        template = template_rootfs(spec.template)  # unknown template -> UnknownTemplateError before any work
        sid = self.table.claim_id(id)
        now = time.time()
        rec = Record(sid, spec, State.CREATING, now, deadline=now + spec.timeout_s if spec.timeout_s else None)
        self.table.register(rec)
        with self.table.locked(sid):
            self.table.save(rec)
            try:
                self.driver.create(sid, self.table.dirs(sid), spec, [template])
            except BaseException:
                self.reclaimer.discard(rec)
                raise
            self.table.set(rec, State.RUNNING)
            return self.table.info(rec)

    def kill(self, sid: str) -> None:
        """Stop the sandbox and release its processes, memory, mounts, cgroups and files (a
        background hibernation in flight stops after its current phase first)."""
        self.hibernator.cancel(sid)
        if self.table.get(sid) is not None:
            # Calls on its agent end now, and fail from here on, those of an operation holding the
            # lock included (a dump's quiesce of a stuck agent): the kill waits for none of their deadlines.
            self.driver.agent(sid, self.table.dirs(sid)).cut("the sandbox is being killed")
        with self.table.locked(sid) as rec:
            self.reclaimer.discard(rec)

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
                self.hibernator.submit(sid)

    def hibernate(self, sid: str) -> CheckpointInfo:
        """Checkpoint, then stop every process: memory and CPU are released; `resume` brings it back.
        Synchronous: returns once the checkpoint is durable and the memory released (see
        `pause(hibernate=True)` for the same in the background). The checkpoint is the caller's,
        listed like any other (E2B's pause, whose checkpoint nobody is handed, keeps its own:
        `Record.hibernation`)."""
        with self.table.locked(sid) as rec:
            self.table.require(rec, "hibernate", *LIVE)
            self.hibernator.take(sid)  # a queued background hibernation of it is this one now
            return self.checkpoints.hibernate(sid)

    def _hibernate_job(self, job: Job) -> None:
        """A background worker's hibernation of `job.sid` (see `pause`)."""
        try:
            with self.table.locked(job.sid) as rec:
                if not self.hibernator.active(job) or rec.state is not State.PAUSED or not rec.then_hibernate:
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
        """`CheckpointService.hibernate` of `rec` (its lock held), made again (up to DUMP_TRIES times) when
        the dump or the agent's quiesce before it fails. A sandbox the driver must thaw for that quiesce
        (one a restarted runtime adopted frozen; the pause's own freeze needs none) wakes every process
        whose timer ran out meanwhile at that instant: one exiting just as CRIU seizes it fails the dump
        ("Unseizable non-zombie"). Each failure leaves the sandbox as it was (frozen), so a second try a
        moment later, past that burst, is safe."""
        for attempt in range(1, DUMP_TRIES + 1):
            try:
                self.checkpoints.hibernate(rec.id, job, internal=True)
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
            self.hibernator.cancel(sid)  # before the lock: its worker holds it while it works
        with self.table.locked(sid) as rec:
            self.table.require(rec, "resume", State.PAUSED, State.HIBERNATED)
            if rec.state is State.PAUSED and rec.then_hibernate and not memory:
                self.hibernator.take(sid)
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
                        self.checkpoints.restore_into(rec, rec.head)
                    else:  # the sealed fs of its last checkpoint under a fresh upper, the template's PID 1
                        self.driver.create(sid, self.table.dirs(sid), rec.spec,
                                           [self.layers.ensure(rec.head), template_rootfs(rec.spec.template)],
                                           sealed_bytes=rec.sealed_bytes)
                except BaseException:  # back to hibernated (`transition`), with nothing of the attempt left
                    with contextlib.suppress(SandboxError):
                        self.driver.destroy(sid, self.table.dirs(sid))
                    self.reclaimer.wipe_upper(rec)
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
