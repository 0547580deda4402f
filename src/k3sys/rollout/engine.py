"""The rollout engine: agent episodes whose sandboxes sleep while the policy thinks.

A turn is: suspend the sandbox (per `pause_policy`), ask the policy for the next command, bring the
sandbox back, run the command, append the result to the episode. `pause_policy`:

    none        the sandbox stays running while the policy thinks (the baseline)
    pause       freeze it (cgroup freezer): no CPU, memory kept; back in a few ms
    hibernate   freeze it, then checkpoint it to the store and stop it in the background while the
                policy thinks: no CPU, no memory; back after a restore (0.1-0.5 s here, more with more memory)
    auto        per turn: hibernate when the expected wait (median of measured policy calls) covers
                the measured hibernate + restore time and the restore stays within
                `auto_latency_budget` of the wait; pause otherwise

`max_live` caps the sandboxes holding memory at once (slots.py: idle ones are hibernated to make
room), which is what lets more episodes run than fit in memory.

Two ways to drive it: `run(tasks, episodes, turns)` runs many episodes concurrently (one thread
each) and returns a `RolloutReport`; or step by step, `start` / `step` / `branch` / `finish`, then
`report()`. Either way one engine runs one session at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from k3sys.rollout.policies import Action, Context, Policy
from k3sys.rollout.records import EpisodeRecord, TurnRecord
from k3sys.rollout.report import RolloutReport
from k3sys.rollout.slots import Slots
from k3sys.rollout.tasks import Task
from k3sys.rollout.usage import UsageSampler
from k3sys.sandbox.errors import (
    CommandExitError,
    CommandTimeoutError,
    InvalidArgumentError,
    InvalidStateError,
    SandboxError,
)
from k3sys.sandbox.sdk.api import Backend, Sandbox

PAUSE_POLICIES = ("none", "pause", "hibernate", "auto")
SandboxFactory = Callable[[str], Sandbox]
# Priors for "auto" until this engine has measured its own (hibernate, resume-from-hibernation)
# seconds; measured on the development host (docs/rollout.md).
PRIOR_HIBERNATE_S, PRIOR_RESUME_S = 0.25, 0.15


def default_factory(runtime: Backend | None = None, cpu: float = 1.0, memory_mb: int = 512) -> SandboxFactory:
    """`template -> Sandbox.create(template, cpu, memory_mb, runtime=runtime)` (runtime: embedded by
    default; a remote client works the same)."""
    return lambda template: Sandbox.create(template, cpu=cpu, memory_mb=memory_mb, runtime=runtime)


def derive_seed(seed: int, name: str) -> int:
    """A 31-bit seed for `name` under `seed` (episode and fork seeds never collide)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "little") >> 1


def _family_order(episodes: dict[str, Episode], id: str) -> tuple:
    """Sort key that puts forks right after their parent: the start and id of each ancestor, root first."""
    chain = []
    while id is not None:
        ep = episodes[id]
        chain.append((ep.start, id))
        id = ep.parent
    return tuple(reversed(chain))


class Episode:
    """A live episode; the engine owns its sandbox. `history` holds its turns so far, `state` the
    engine's view of the sandbox: running, paused, hibernated or gone."""

    def __init__(self, id: str, task: Task, seed: int, now: float, parent: str | None = None,
                 history: Sequence[TurnRecord] = ()) -> None:
        self.id, self.task, self.seed, self.parent = id, task, seed, parent
        self.branched_at = len(history) if parent is not None else None
        self.history = list(history)
        self.sandbox: Sandbox | None = None
        self.state = "gone"
        self.start = now
        self.forks = 0
        self.error: str | None = None
        self.record: EpisodeRecord | None = None
        self.lock = threading.RLock()  # held across every operation on the sandbox
        self.pending: Future | None = None  # the background hibernation, while in flight
        self.intervals: list[tuple[str, float, float]] = []
        self._phase: tuple[str, float] | None = None
        self._mu = threading.Lock()

    def mark(self, phase: str | None, now: float) -> None:
        """Close the current timeline interval at `now` and open `phase` (None: close only)."""
        with self._mu:
            if self._phase is not None:
                self.intervals.append((self._phase[0], self._phase[1], now))
            self._phase = (phase, now) if phase is not None else None

    def __repr__(self) -> str:
        return f"Episode({self.id!r}, task={self.task.name!r}, turns={len(self.history)}, state={self.state!r})"


class _Session:
    """One run's shared machinery: the clock origin, usage sampler, slots and background pool."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.t0 = time.perf_counter()
        self.sampler = UsageSampler(engine.sample_interval_s, self.t0)
        self.slots = Slots(engine.max_live, engine._evict)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="k3sys-rollout-hibernate")
        self.episodes: dict[str, Episode] = {}
        self.mu = threading.Lock()
        self.sampler.start()


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidArgumentError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


class RolloutEngine:
    """Runs agent episodes of `policy` in sandboxes from `sandbox_factory` (default: embedded runtime,
    1 core, 512 MiB); see the module docstring for `pause_policy` and `max_live`.

    `sample_interval_s`: how often cgroup counters are read. `action_timeout_s`: an action running
    longer is killed and reported with exit code 124. `observation_chars`: output kept per turn.
    """

    def __init__(self, policy: Policy, sandbox_factory: SandboxFactory | None = None, pause_policy: str = "pause",
                 max_live: int | None = None, *, sample_interval_s: float = 0.05, auto_latency_budget: float = 0.1,
                 action_timeout_s: float = 60.0, observation_chars: int = 4096) -> None:
        if not callable(policy):
            raise InvalidArgumentError(f"policy must be callable, got {policy!r}")
        if pause_policy not in PAUSE_POLICIES:
            raise InvalidArgumentError(f"pause_policy must be one of {PAUSE_POLICIES}, got {pause_policy!r}")
        if max_live is not None:
            _check_int("max_live", max_live, 1)
        if not isinstance(auto_latency_budget, int | float) or not 0 < auto_latency_budget <= 1:
            raise InvalidArgumentError(f"auto_latency_budget must be in (0, 1], got {auto_latency_budget!r}")
        self.policy = policy
        self.factory = sandbox_factory or default_factory()
        self.pause_policy, self.max_live = pause_policy, max_live
        self.sample_interval_s, self.auto_latency_budget = sample_interval_s, auto_latency_budget
        self.action_timeout_s, self.observation_chars = action_timeout_s, observation_chars
        # Measured seconds behind "auto": policy calls, hibernations, resumes from hibernation.
        self._think: deque[float] = deque(maxlen=64)
        self._hibernate_s: deque[float] = deque(maxlen=64)
        self._resume_s: deque[float] = deque(maxlen=64)
        self._session: _Session | None = None
        self._session_mu = threading.Lock()

    # --- session plumbing -----------------------------------------------------------------------

    def _open(self) -> _Session:
        with self._session_mu:
            if self._session is None:
                self._session = _Session(self)
            return self._session

    @property
    def _s(self) -> _Session:
        if self._session is None:
            raise InvalidStateError("no rollout session: start() an episode first")
        return self._session

    def _now(self) -> float:
        return time.perf_counter() - self._s.t0

    def sandbox(self, episode: str) -> Sandbox | None:
        """The sandbox of live episode `episode` (None once it is finished)."""
        ep = self._s.episodes.get(episode)
        if ep is None:
            raise InvalidArgumentError(f"episode: no episode {episode!r} in this session")
        return ep.sandbox if ep.record is None else None

    @contextlib.contextmanager
    def _guard(self, ep: Episode) -> Iterator[None]:
        """On any failure: record it on the episode, release its sandbox, close it, re-raise."""
        if ep.record is not None:
            raise InvalidStateError(f"episode {ep.id} is finished")
        try:
            yield
        except BaseException as e:
            ep.error = ep.error or f"{type(e).__name__}: {e}"
            self._close(ep, None)
            raise

    # --- the life of an episode -----------------------------------------------------------------

    def start(self, task: Task, seed: int = 0, id: str | None = None) -> Episode:
        """Create a sandbox for `task` (waiting for a live slot if `max_live` says so) and set it up."""
        if not isinstance(task, Task):
            raise InvalidArgumentError(f"task must be a Task, got {task!r}")
        s = self._open()
        with s.mu:
            id = id or f"e{len(s.episodes)}"
            if id in s.episodes:
                raise InvalidArgumentError(f"id: episode {id!r} already exists in this session")
            ep = s.episodes[id] = Episode(id, task, seed, self._now())
        with self._guard(ep):
            ep.mark("queued", self._now())
            s.slots.acquire(ep.id, self._now)
            ep.mark("setup", self._now())
            with ep.lock:
                ep.sandbox = self.factory(task.template)
                ep.state = "running"
                s.sampler.track(ep.id, ep.sandbox)
                task.setup(ep.sandbox)
        return ep

    def step(self, ep: Episode) -> TurnRecord:
        """One turn: suspend the sandbox, ask the policy, bring the sandbox back, run the action."""
        with self._guard(ep):
            suspend = self._suspend(ep)
            ctx = Context(ep.task, tuple(ep.history), ep.id, ep.seed)
            t_think = self._now()
            out = self.policy(ctx)
            think_s = self._now() - t_think
            self._think.append(think_s)
            action = out if isinstance(out, Action) else Action(str(out))
            t_resume = self._now()
            self._make_live(ep)
            with ep.lock:
                t_act = self._now()
                ep.mark("act", t_act)
                try:
                    r = ep.sandbox.commands.run(action.command, timeout=self.action_timeout_s)
                    code, out_text = r.exit_code, r.stdout + r.stderr
                except CommandExitError as e:
                    code, out_text = e.exit_code, e.stdout + e.stderr
                except CommandTimeoutError as e:
                    code, out_text = 124, f"{e.stdout}{e.stderr}[killed after {self.action_timeout_s:g} s]"
                action_s = self._now() - t_act
            turn = TurnRecord(len(ep.history), action.command, code, out_text[-self.observation_chars:], t_think,
                              think_s, t_act - t_resume, action_s, suspend, action.text)
            ep.history.append(turn)
            return turn

    def branch(self, ep: Episode, n: int) -> list[Episode]:
        """Fork `ep`'s sandbox now into `n` new episodes that continue from its current turn (the
        GRPO-style group: the prefix is run once, not once per member). Returns the new episodes."""
        _check_int("n", n, 1)
        s = self._s
        if self.max_live is not None and n + 1 > self.max_live:
            raise InvalidArgumentError(f"n: a fork of {n} needs {n + 1} live sandboxes, max_live is {self.max_live}")
        with self._guard(ep):
            s.slots.acquire(ep.id, self._now, extra=n)
            t0 = self._now()
            try:
                self._wait_pending(ep)
                with ep.lock:
                    self._resume_locked(ep)
                    ep.mark("fork", t0)
                    sandboxes = ep.sandbox.fork(n)
            except BaseException:
                s.slots.unreserve(n)
                raise
            t1 = self._now()
            kids = []
            for sbx in sandboxes:
                ep.forks += 1
                name = f"{ep.id}.{ep.forks}"
                kid = Episode(name, ep.task, derive_seed(ep.seed, name), t0, parent=ep.id, history=ep.history)
                kid.sandbox, kid.state = sbx, "running"
                kid.intervals.append(("fork", t0, t1))
                kid.mark("act", t1)
                with s.mu:
                    s.episodes[name] = kid
                s.slots.grant(name)
                s.sampler.track(name, sbx)
                kids.append(kid)
            ep.mark("act", t1)
            return kids

    def finish(self, ep: Episode) -> EpisodeRecord:
        """Score the episode with its task's reward, kill its sandbox, and return its record."""
        with self._guard(ep):
            self._make_live(ep)
            with ep.lock:
                ep.mark("act", self._now())
                reward = float(ep.task.reward(ep.sandbox))
        return self._close(ep, reward)

    def report(self) -> RolloutReport:
        """Close the session (every episode must be finished) and return its report."""
        s = self._s
        live = sorted(k for k, ep in s.episodes.items() if ep.record is None)
        if live:
            raise InvalidStateError(f"episodes {', '.join(live)} are not finished: finish() them first")
        end = self._now()
        s.sampler.stop()
        s.pool.shutdown()
        with self._session_mu:
            self._session = None
        records = sorted((ep.record for ep in s.episodes.values()), key=lambda r: _family_order(s.episodes, r.id))
        return RolloutReport(self.pause_policy, self.max_live, records, list(s.sampler.totals), end, s.slots.peak)

    # --- suspend / resume -----------------------------------------------------------------------

    def decide(self) -> str:
        """What the sandbox does during the next policy call: "none", "pause" or "hibernate"."""
        if self.pause_policy != "auto":
            return self.pause_policy
        wait = statistics.median(self._think) if self._think else getattr(self.policy, "expected_think_s", None)
        if wait is None:
            return "pause"
        hib = statistics.median(self._hibernate_s) if self._hibernate_s else PRIOR_HIBERNATE_S
        res = statistics.median(self._resume_s) if self._resume_s else PRIOR_RESUME_S
        return "hibernate" if wait >= max(hib + res, res / self.auto_latency_budget) else "pause"

    def _suspend(self, ep: Episode) -> str:
        s, mode = self._s, self.decide()
        with ep.lock:
            if mode == "none":
                ep.mark("idle", self._now())
            else:
                ep.mark("pausing", self._now())
                ep.sandbox.pause()
                ep.state = "paused"
                ep.mark("paused", self._now())
                s.sampler.sample(ep.id)
        if mode == "hibernate":
            # Not evictable meanwhile: it is on its way out already.
            ep.pending = s.pool.submit(self._hibernate, ep)
        else:
            s.slots.set_idle(ep.id, self._now())
        return mode

    def _hibernate(self, ep: Episode) -> None:
        s = self._s
        with ep.lock:
            if ep.state == "running":
                ep.mark("pausing", self._now())
                ep.sandbox.pause()
                ep.state = "paused"
            s.sampler.sample(ep.id)  # frozen: the cgroup's count is final before it goes away
            t0 = self._now()
            ep.mark("hibernating", t0)
            ep.sandbox.hibernate()
            t1 = self._now()
            self._hibernate_s.append(t1 - t0)
            ep.state = "hibernated"
            ep.mark("hibernated", t1)
            s.sampler.sample(ep.id)
        s.slots.release(ep.id)

    def _evict(self, key: Any) -> None:
        """Hibernate idle episode `key` for a slot; on failure kill its sandbox (the slot must free)."""
        ep = self._s.episodes[key]
        try:
            self._hibernate(ep)
        except Exception as e:
            ep.error = f"eviction failed: {type(e).__name__}: {e}"
            with ep.lock:
                self._kill(ep)
            self._s.slots.release(ep.id)

    def _wait_pending(self, ep: Episode) -> None:
        fut, ep.pending = ep.pending, None
        if fut is not None:
            fut.result()

    def _make_live(self, ep: Episode) -> None:
        """Bring the sandbox back to running, holding a live slot."""
        self._wait_pending(ep)
        self._s.slots.acquire(ep.id, self._now)
        with ep.lock:
            self._resume_locked(ep)

    def _resume_locked(self, ep: Episode) -> None:
        if ep.error is not None:
            raise InvalidStateError(f"episode {ep.id}: {ep.error}")
        if ep.state in ("paused", "hibernated"):
            hibernated = ep.state == "hibernated"
            t0 = self._now()
            ep.mark("resuming", t0)
            ep.sandbox.resume()
            if hibernated:
                self._resume_s.append(self._now() - t0)
            ep.state = "running"
            self._s.sampler.sample(ep.id)
        elif ep.state != "running":
            raise InvalidStateError(f"episode {ep.id}: its sandbox is {ep.state}")
        self._s.slots.set_idle(ep.id, None)

    def _kill(self, ep: Episode) -> None:
        """Take the last reading and kill the sandbox (ep.lock held)."""
        if ep.sandbox is not None and ep.state != "gone":
            self._s.sampler.untrack(ep.id)
            with contextlib.suppress(SandboxError):
                ep.sandbox.kill()
            ep.state = "gone"

    def _close(self, ep: Episode, reward: float | None) -> EpisodeRecord:
        s = self._s
        with contextlib.suppress(Exception):  # a failed hibernation already counts as the episode's error
            self._wait_pending(ep)
        with ep.lock:
            self._kill(ep)
            end = self._now()
            ep.mark(None, end)
        s.slots.release(ep.id)
        u = s.sampler.usage.get(ep.id)
        ep.record = EpisodeRecord(
            ep.id, ep.task.name, ep.seed, ep.sandbox.id if ep.sandbox else "", ep.parent, ep.branched_at,
            list(ep.history), reward if ep.error is None else None, ep.error, ep.start, end, list(ep.intervals),
            u.cpu_s if u else 0.0, u.mem_gb_s if u else 0.0, u.peak_bytes if u else 0, list(u.series) if u else [],
            ep.forks)
        return ep.record

    # --- many episodes at once --------------------------------------------------------------------

    def run(self, tasks: Sequence[Task], episodes: int = 8, turns: int = 6, *, group: int = 1, branch_at: int = 0,
            seed: int = 0, compare_none: bool = False,
            on_turn: Callable[[str, TurnRecord], None] | None = None) -> RolloutReport:
        """Run `episodes` episodes of `turns` turns concurrently (episode i on `tasks[i % len(tasks)]`).

        `group` > 1 forks each episode after `branch_at` turns into `group` members (itself and
        `group - 1` forks) that each play the remaining turns. `compare_none`: afterwards run the
        same episodes again with pause_policy "none" (no `max_live`) and attach it as `baseline`.
        `on_turn(episode id, turn)` is called after every turn (from the episode's thread).
        """
        tasks = list(tasks)
        if not tasks or not all(isinstance(t, Task) for t in tasks):
            raise InvalidArgumentError(f"tasks must be a non-empty sequence of Task, got {tasks!r}")
        _check_int("episodes", episodes, 1)
        _check_int("turns", turns, 0)
        _check_int("group", group, 1)
        _check_int("branch_at", branch_at, 0)
        if group > 1 and branch_at >= max(turns, 1):
            raise InvalidArgumentError(f"branch_at must be < turns ({turns}) for a group, got {branch_at}")
        if group > 1 and self.max_live is not None and group > self.max_live:
            raise InvalidArgumentError(f"group ({group}) must be <= max_live ({self.max_live}): a fork needs "
                                       "every member live at once")
        if self._session is not None:
            raise InvalidStateError("a session is open: finish its episodes and call report() first")
        report = self._run_threads(tasks, episodes, turns, group, branch_at, seed, on_turn)
        if compare_none and self.pause_policy != "none":
            base = RolloutEngine(self.policy, self.factory, "none", None, sample_interval_s=self.sample_interval_s,
                                 action_timeout_s=self.action_timeout_s, observation_chars=self.observation_chars)
            report.baseline = base._run_threads(tasks, episodes, turns, group, branch_at, seed, on_turn)
        return report

    def _run_threads(self, tasks: list[Task], episodes: int, turns: int, group: int, branch_at: int, seed: int,
                     on_turn: Callable[[str, TurnRecord], None] | None) -> RolloutReport:
        threads: list[threading.Thread] = []
        mu = threading.Lock()

        def spawn(fn: Callable[..., None], *args: Any) -> None:
            t = threading.Thread(target=fn, args=args, daemon=True)
            with mu:
                threads.append(t)
            t.start()

        def play(ep: Episode) -> None:
            # Failures are recorded on the episode (see _guard); the others carry on.
            with contextlib.suppress(Exception):
                for t in range(len(ep.history), turns):
                    if group > 1 and ep.parent is None and t == branch_at:
                        for kid in self.branch(ep, group - 1):
                            spawn(play, kid)
                    turn = self.step(ep)
                    if on_turn is not None:
                        with self._guard(ep):  # a failing callback ends its episode like a failing turn
                            on_turn(ep.id, turn)
                self.finish(ep)

        def root(i: int) -> None:
            name = f"e{i}"
            with contextlib.suppress(Exception):
                play(self.start(tasks[i % len(tasks)], derive_seed(seed, name), name))

        s = self._open()
        for i in range(episodes):
            spawn(root, i)
        joined = 0
        try:
            while True:
                with mu:
                    if joined == len(threads):
                        break
                    t = threads[joined]
                t.join()
                joined += 1
        except BaseException:  # interrupted: leave no sandbox behind
            for ep in list(s.episodes.values()):
                with contextlib.suppress(Exception):
                    self._kill(ep)
            raise
        return self.report()
