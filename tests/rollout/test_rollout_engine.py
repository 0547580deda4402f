"""The rollout engine against real runc + CRIU sandboxes: each action runs once in its own sandbox,
sandboxes are really frozen (or gone) while the policy thinks, forks continue from the right turn,
max_live holds, and the cgroup accounting shows what pausing saves."""

from __future__ import annotations

import time

import pytest
from waiting import wait_until

from k3sys.rollout import RolloutEngine, ScriptedPolicy, Task, default_factory
from k3sys.rollout.tasks import start_service
from k3sys.sandbox import InvalidArgumentError

pytestmark = pytest.mark.timeout(180)

LIVE = {"setup", "fork", "act", "idle", "pausing", "paused", "hibernating", "resuming"}


def log_task(logs: dict[str, str], resident_mb: int = 0, poll_ms: int = 0) -> Task:
    """Busybox task whose actions append to /work/log; the reward keeps the log (by sandbox id)."""

    def setup(sbx):
        start_service(sbx, resident_mb, poll_ms)

    def reward(sbx):
        logs[sbx.id] = sbx.files.read_text("/work/log") if sbx.files.exists("/work/log") else ""
        return 1.0

    return Task("log", "busybox", "append to /work/log", setup, (), ":", reward)


class LogPolicy:
    """Appends "<episode>:<turn>" to /work/log; `probe(ctx)` runs while it thinks (default: a short sleep)."""

    def __init__(self, probe=None, think_s: float = 0.05) -> None:
        self.probe, self.think_s = probe, think_s

    def __call__(self, ctx):
        if self.probe is not None:
            self.probe(ctx)
        else:
            time.sleep(self.think_s)
        return f"echo {ctx.episode}:{ctx.turn} >> /work/log"


def logs_by_episode(report, logs):
    return {e.id: logs[e.sandbox_id].split() for e in report.episodes}


@pytest.mark.parametrize("pause_policy", ["none", "pause", "hibernate", "auto"])
def test_every_action_runs_once_in_its_own_sandbox(rt, pause_policy):
    logs: dict[str, str] = {}
    engine = RolloutEngine(LogPolicy(), default_factory(rt, memory_mb=64), pause_policy)
    report = engine.run([log_task(logs)], episodes=2, turns=3)
    assert report.errors == []
    got = logs_by_episode(report, logs)
    assert got == {e: [f"{e}:{t}" for t in range(3)] for e in ("e0", "e1")}
    for e in report.episodes:
        assert [t.turn for t in e.turns] == [0, 1, 2]
        assert all(t.exit_code == 0 for t in e.turns)
        want = {"none": "none", "pause": "pause", "hibernate": "hibernate", "auto": "pause"}[pause_policy]
        assert {t.suspend for t in e.turns} == {want}  # auto: 50 ms thinks are too short to hibernate
    assert not {i.id for i in rt.list()} & {e.sandbox_id for e in report.episodes}  # all killed


@pytest.mark.parametrize("pause_policy", ["none", "pause", "hibernate"])
def test_sandbox_sleeps_while_the_policy_thinks(rt, pause_policy):
    """Probed from inside the policy call: state, CPU charged across 0.4 s, memory held."""
    seen = []

    def probe(ctx):
        sbx = engine.sandbox(ctx.episode)
        if pause_policy == "hibernate":
            wait_until(lambda: sbx.state == "hibernated", 10, "the paused episode's hibernation", step=0.02)
        cpu0 = sbx.cpu_seconds()
        time.sleep(0.4)  # "no CPU while paused" needs a window (a running sandbox uses some within it)
        seen.append((sbx.state, sbx.cpu_seconds() - cpu0, sbx.memory_bytes()))

    engine = RolloutEngine(LogPolicy(probe), default_factory(rt, memory_mb=64), pause_policy)
    report = engine.run([log_task({}, resident_mb=4, poll_ms=10)], episodes=1, turns=2)
    assert report.errors == []
    assert len(seen) == 2
    for state, cpu, mem in seen:
        if pause_policy == "none":
            assert state == "running" and cpu > 0 and mem > 4 << 20
        elif pause_policy == "pause":
            assert state == "paused" and cpu == 0 and mem > 4 << 20
        else:
            assert state == "hibernated" and cpu == 0 and mem == 0


def test_forks_continue_from_the_branch_turn(rt):
    logs: dict[str, str] = {}
    engine = RolloutEngine(LogPolicy(), default_factory(rt, memory_mb=64), "pause")
    report = engine.run([log_task(logs)], episodes=1, turns=4, group=3, branch_at=2)
    assert report.errors == []
    assert [e.id for e in report.episodes] == ["e0", "e0.1", "e0.2"]
    got = logs_by_episode(report, logs)
    prefix = ["e0:0", "e0:1"]  # ran once, in the parent, before the fork
    assert got["e0"] == prefix + ["e0:2", "e0:3"]
    for kid in ("e0.1", "e0.2"):
        assert got[kid] == prefix + [f"{kid}:2", f"{kid}:3"]
    parent = report.episodes[0]
    for kid in report.episodes[1:]:
        assert kid.parent == "e0" and kid.branched_at == 2
        assert kid.turns[:2] == parent.turns[:2] and len(kid.own_turns) == 2
        assert kid.sandbox_id != parent.sandbox_id
    assert report.totals["forks"] == 2 and report.totals["prefix_turns_reused"] == 4
    assert report.totals["turns"] == 4 + 2 * 2


def test_max_live_caps_sandboxes_holding_memory(rt):
    logs: dict[str, str] = {}
    engine = RolloutEngine(LogPolicy(think_s=0.3), default_factory(rt, memory_mb=64), "pause", max_live=2)
    report = engine.run([log_task(logs, resident_mb=2)], episodes=4, turns=2)
    assert report.errors == []
    assert logs_by_episode(report, logs) == {e: [f"{e}:0", f"{e}:1"] for e in ("e0", "e1", "e2", "e3")}
    # From the timelines: never more than 2 sandboxes live at once (evicted ones were hibernated).
    edges = sorted((t, +1 if start else -1) for e in report.episodes for s, t0, t1 in e.intervals if s in LIVE
                   for t, start in ((t0, True), (t1, False)))
    live, peak = 0, 0
    for _, d in sorted(edges, key=lambda x: (x[0], x[1])):  # ends before starts at the same instant
        live += d
        peak = max(peak, live)
    assert peak <= 2 and report.peak_live <= 2
    assert report.totals["hibernated_s"] > 0  # the cap was met by hibernating idle episodes


def test_auto_follows_measured_think_times(rt):
    """A policy that claims 10 s thinks but answers in 50 ms: "auto" hibernates on its word for the
    first turn, then pauses once it has measured the real waits."""
    policy = LogPolicy()
    policy.expected_think_s = 10.0
    engine = RolloutEngine(policy, default_factory(rt, memory_mb=64), "auto")
    report = engine.run([log_task({})], episodes=1, turns=3)
    assert report.errors == []
    assert [t.suspend for t in report.episodes[0].turns] == ["hibernate", "pause", "pause"]


def test_accounting_pausing_saves_cpu_and_hibernating_saves_memory(rt):
    """Long thinks, a busy agent service (16 MiB, polling every 20 ms): CPU-seconds charged with
    pausing below the "none" run's; memory GB-seconds with hibernation well below it.

    Each hibernation still holds the memory from the freeze until the checkpoint is durable, and a
    resume charges it again before it returns: 0.5-0.8 s a turn on this 2-core machine at load 4,
    over 1 s at load 8, on top of the setup both runs hold. 3 s thinks keep the comparison about
    the policy rather than the machine's load (1.5 s ones gave 0.24-0.76 of "none", at 8619c9e too).
    """
    policy = ScriptedPolicy(think_ms=3000, distribution="fixed")
    tasks = [log_task({}, resident_mb=16, poll_ms=20)]
    factory = default_factory(rt, memory_mb=128)
    paused = RolloutEngine(policy, factory, "pause").run(tasks, episodes=2, turns=2, compare_none=True)
    hibernated = RolloutEngine(policy, factory, "hibernate").run(tasks, episodes=2, turns=2)
    none = paused.baseline
    for r in (paused, hibernated, none):
        assert r.errors == []
    assert paused.totals["cpu_s"] < 0.7 * none.totals["cpu_s"]
    # Relative to the time spent hibernated, not a fixed ratio of "none": the saving is at least half
    # of what those seconds held in the "none" run (its memory per sandbox-second). Under load each
    # freeze, dump and resume holds the memory longer and the hibernated seconds shrink with it (a
    # fixed 0.6 ratio failed at 0.74 at load 14).
    rate = none.totals["mem_gb_s"] / sum(e.wall_s for e in none.episodes)
    saved = none.totals["mem_gb_s"] - hibernated.totals["mem_gb_s"]
    assert hibernated.totals["hibernated_s"] > 0 and saved >= 0.5 * rate * hibernated.totals["hibernated_s"], \
        (saved, rate, hibernated.totals)
    # Independent floor: each "none" sandbox holds the service's 16 MiB from setup to its end.
    for e in none.episodes:
        assert e.peak_mem_bytes >= 16 << 20
        held_s = e.end - next(t1 for s, _, t1 in e.intervals if s == "setup")
        assert e.mem_gb_s >= 0.9 * (16 << 20) * held_s / 1e9
    assert paused.totals["waiting_frac"] > 0.5


def test_bad_arguments_are_rejected(rt):
    policy = LogPolicy()
    with pytest.raises(InvalidArgumentError, match="pause_policy"):
        RolloutEngine(policy, pause_policy="sleep")
    with pytest.raises(InvalidArgumentError, match="max_live"):
        RolloutEngine(policy, max_live=0)
    engine = RolloutEngine(policy, default_factory(rt), max_live=2)
    with pytest.raises(InvalidArgumentError, match="group"):
        engine.run([log_task({})], episodes=1, turns=2, group=3)
    with pytest.raises(InvalidArgumentError, match="branch_at"):
        engine.run([log_task({})], episodes=1, turns=2, group=2, branch_at=2)
    with pytest.raises(InvalidArgumentError, match="tasks"):
        engine.run([], episodes=1)
    with pytest.raises(InvalidArgumentError, match="episodes"):
        engine.run([log_task({})], episodes=0)


def test_a_failing_on_turn_callback_ends_only_its_episode(rt):
    logs: dict[str, str] = {}
    engine = RolloutEngine(LogPolicy(), default_factory(rt, memory_mb=64), "pause")

    def on_turn(episode, turn):
        if episode == "e1" and turn.turn == 1:
            raise RuntimeError("callback broke")

    report = engine.run([log_task(logs)], episodes=2, turns=3, on_turn=on_turn)
    assert [e.id for e in report.episodes if e.error] == ["e1"] and "callback broke" in report.episodes[1].error
    assert [len(e.turns) for e in report.episodes] == [3, 2]
    assert not {i.id for i in rt.list()} & {e.sandbox_id for e in report.episodes}  # all killed
    engine.run([log_task(logs)], episodes=1, turns=1)  # the session was closed: the engine runs again
