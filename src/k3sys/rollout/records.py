"""What a rollout records: one `TurnRecord` per turn, one `EpisodeRecord` per episode.

Times are seconds; instants (`start`, `think_start`, interval bounds) are seconds since the run began.
Sandbox states on an episode's timeline:

    setup       creating the sandbox and running the task's setup
    fork        snapshotting the sandbox for forks (a fork's own timeline starts with it too)
    act         running the policy's action (or the reward check at the end)
    idle        running, nothing to do: the policy is thinking (pause_policy "none")
    pausing, paused, hibernating, hibernated, resuming
    queued      waiting for a live slot (`max_live`), sandbox hibernated or not yet created
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATES = ("setup", "fork", "act", "idle", "pausing", "paused", "hibernating", "hibernated", "resuming", "queued")
# Sandbox states that do work for the episode (the "running" side of running vs waiting).
WORKING = ("setup", "fork", "act")


@dataclass(frozen=True)
class TurnRecord:
    """One turn: the policy thought (`think_s`), the sandbox was brought back (`resume_s`, the latency
    pausing adds to the turn), the action ran (`action_s`). `suspend` is what the sandbox did while
    the policy thought: "none", "pause" or "hibernate". `text` is what the policy wrote besides the
    command (the model's generated text for `ModelPolicy`)."""

    turn: int
    action: str
    exit_code: int
    observation: str
    think_start: float
    think_s: float
    resume_s: float
    action_s: float
    suspend: str
    text: str = ""


@dataclass
class EpisodeRecord:
    """One episode, finished. `parent`/`branched_at`: the episode it was forked from and after how many
    of its turns (None for a root episode); its first `branched_at` turns are the parent's, not re-run.
    `intervals` is the sandbox's timeline as (state, start, end). `cpu_s` (CPU seconds) and `mem_gb_s`
    (resident GB-seconds, GB = 1e9 bytes) come from the sandbox's cgroup counters; `mem_series` holds
    the memory samples as (instant, bytes)."""

    id: str
    task: str
    seed: int
    sandbox_id: str
    parent: str | None
    branched_at: int | None
    turns: list[TurnRecord]
    reward: float | None
    error: str | None
    start: float
    end: float
    intervals: list[tuple[str, float, float]]
    cpu_s: float
    mem_gb_s: float
    peak_mem_bytes: int
    mem_series: list[tuple[float, int]] = field(repr=False)
    forks: int = 0

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def state_s(self) -> dict[str, float]:
        """Seconds the sandbox spent in each timeline state."""
        out = dict.fromkeys(STATES, 0.0)
        for state, t0, t1 in self.intervals:
            out[state] += t1 - t0
        return out

    @property
    def own_turns(self) -> list[TurnRecord]:
        """Turns this episode ran itself (a fork's inherited prefix excluded)."""
        return self.turns[self.branched_at or 0:]

    @property
    def running_s(self) -> float:
        """Seconds the sandbox worked for the episode (setup, forks, actions, reward check)."""
        s = self.state_s()
        return sum(s[k] for k in WORKING)

    @property
    def waiting_s(self) -> float:
        """Seconds the episode waited for the policy."""
        return sum(t.think_s for t in self.own_turns)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(wall_s=self.wall_s, running_s=self.running_s, waiting_s=self.waiting_s, state_s=self.state_s())
        return d
