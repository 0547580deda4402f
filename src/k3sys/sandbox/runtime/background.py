"""Background hibernation: `Runtime.pause(sid, hibernate=True)` freezes a sandbox (the cgroup
freezer, milliseconds: no CPU from then on), marks its record `then_hibernate` and returns; a worker
of one bounded pool runs the ordinary hibernation (CRIU dump, store commit, stop) `delay_s` seconds
later. Until that hibernation is durable the processes stay frozen, never killed, so a `resume` in
the meantime is a thaw, not a restore. What a `resume` (or `kill`) meets, by the job's phase:

    queued      waiting for its delay or a free worker: the job is dropped; the sandbox thaws at once
    dumping     CRIU holds the processes and cannot be stopped safely: the caller waits for the dump,
                whose images are then dropped (the store's follower aborted); the sandbox thaws
    committing  the store has no clean way to stop a commit: the caller waits for it; the checkpoint
                is kept as the sandbox's head (a plain checkpoint), and the sandbox thaws
    done        the processes are gone: the ordinary restore

`Hibernator` is the queue and its workers; the life cycle (lifecycle.py), which owns it, does the
locking (the worker takes the sandbox's lock like any operation; a `resume` cancels before it waits
for that lock).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class Cancelled(Exception):
    """A background hibernation stopped early because its job was cancelled (the sandbox is paused)."""


@dataclass(eq=False)
class Job:
    """One background hibernation of sandbox `sid`, due at `due` (monotonic seconds). `cancelled`
    is set (under the hibernator's lock) by `cancel`; the worker reads it between phases."""

    sid: str
    due: float
    cancelled: bool = False
    started: bool = False
    order: int = 0  # submission order: ties of `due` run first come, first served


class Hibernator:
    """A queue of `Job`s ordered by due time and `workers` threads that each call `run(job)`.

    A sandbox has at most one live job (`submit` replaces an older one, which is cancelled). `close`
    stops the workers after the jobs they are running; jobs still queued are left (the record's
    `then_hibernate` tells the next runtime to queue them again).
    """

    def __init__(self, run: Callable[[Job], None], workers: int, delay_s: float) -> None:
        self._run = run
        self.delay_s = delay_s
        self._cv = threading.Condition()
        self._queue: list[tuple[float, int, Job]] = []  # (due, submission order, job), sorted
        self._jobs: dict[str, Job] = {}  # sandbox id -> its live job (queued or running)
        self._count = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"k3sys-sandbox-hibernate-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, sid: str, delay_s: float | None = None) -> Job:
        """Queue a hibernation of `sid` in `delay_s` seconds (default: the hibernator's)."""
        with self._cv:
            old = self._jobs.get(sid)
            if old is not None:
                self._cancel_locked(old)
            self._count += 1
            job = Job(sid, time.monotonic() + (self.delay_s if delay_s is None else delay_s), order=self._count)
            self._jobs[sid] = job
            bisect.insort(self._queue, (job.due, job.order, job), key=lambda e: e[:2])
            self._cv.notify()
            return job

    def cancel(self, sid: str) -> Job | None:
        """Cancel `sid`'s job: a queued one never runs; a running one stops after its current phase
        (see the module docstring). Returns the job (None: there was none)."""
        with self._cv:
            job = self._jobs.get(sid)
            if job is not None:
                self._cancel_locked(job)
            return job

    def take(self, sid: str) -> bool:
        """Drop `sid`'s job if it has not started (its caller hibernates the sandbox itself);
        returns whether a queued job was dropped."""
        with self._cv:
            job = self._jobs.get(sid)
            if job is None or job.started:
                return False
            self._cancel_locked(job)
            return True

    def active(self, job: Job) -> bool:
        """Whether `job` is still its sandbox's live, uncancelled job."""
        with self._cv:
            return not job.cancelled and self._jobs.get(job.sid) is job

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cv:
            return len(self._jobs)

    def _cancel_locked(self, job: Job) -> None:
        job.cancelled = True
        if self._jobs.get(job.sid) is job:
            del self._jobs[job.sid]
        if not job.started:
            i = bisect.bisect_left(self._queue, (job.due, job.order), key=lambda e: e[:2])
            if i < len(self._queue) and self._queue[i][2] is job:
                del self._queue[i]

    def _next(self) -> Job | None:
        """The next due job, waiting for it (None once closed)."""
        with self._cv:
            while not self._closed:
                if self._queue:
                    wait = self._queue[0][0] - time.monotonic()
                    if wait <= 0:
                        job = self._queue.pop(0)[2]
                        job.started = True
                        return job
                else:
                    wait = None
                self._cv.wait(wait)
            return None

    def _work(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._run(job)
            finally:
                with self._cv:
                    if self._jobs.get(job.sid) is job:
                        del self._jobs[job.sid]

    def close(self) -> None:
        """Stop the workers once their running jobs are done (queued jobs stay undone)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
