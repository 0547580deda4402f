"""`RolloutReport`: per-episode records, totals, tables, JSON and the HTML report.

`totals` (seconds, CPU-seconds, GB-seconds with GB = 1e9 bytes):

    wall_s        the run, from its first episode's start to its report
    running_s     sandboxes working for their episodes (setup, forks, actions, reward checks)
    waiting_s     episodes waiting for the policy; waiting_frac = waiting / (running + waiting)
    cpu_s         CPU time charged to the sandboxes' cgroups
    mem_gb_s      resident memory charged to the sandboxes' cgroups, integrated over time
    paused_s, hibernated_s   sandbox time spent in those states
    added_latency_s          mean per turn, from the policy's answer to the action's start
    peak_mem_gb   most memory held by all sandboxes at one sample; peak_live: most live slots used
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from k3sys.rollout.records import EpisodeRecord


@dataclass
class RolloutReport:
    """A finished rollout; `baseline` is the same run with pause_policy "none", when it was asked for.
    `mem_totals` holds (instant s, bytes held by all sandboxes) per sampler tick."""

    pause_policy: str
    max_live: int | None
    episodes: list[EpisodeRecord]
    mem_totals: list[tuple[float, int]] = field(repr=False)
    wall_s: float
    peak_live: int
    baseline: RolloutReport | None = None

    @property
    def errors(self) -> list[tuple[str, str]]:
        """(episode id, error) of every failed episode."""
        return [(e.id, e.error) for e in self.episodes if e.error]

    @property
    def totals(self) -> dict[str, float]:
        eps = self.episodes
        turns = [t for e in eps for t in e.own_turns]
        states = [e.state_s() for e in eps]
        running, waiting = sum(e.running_s for e in eps), sum(e.waiting_s for e in eps)
        rewards = [e.reward for e in eps if e.reward is not None]
        return {
            "episodes": len(eps),
            "turns": len(turns),
            "forks": sum(e.forks for e in eps),
            "prefix_turns_reused": sum(e.branched_at or 0 for e in eps),
            "errors": len(self.errors),
            "mean_reward": statistics.fmean(rewards) if rewards else float("nan"),
            "wall_s": self.wall_s,
            "running_s": running,
            "waiting_s": waiting,
            "waiting_frac": waiting / (running + waiting) if running + waiting else 0.0,
            "cpu_s": sum(e.cpu_s for e in eps),
            "mem_gb_s": sum(e.mem_gb_s for e in eps),
            "paused_s": sum(s["paused"] for s in states),
            "hibernated_s": sum(s["hibernated"] for s in states),
            "think_s_per_turn": statistics.fmean(t.think_s for t in turns) if turns else 0.0,
            "action_s_per_turn": statistics.fmean(t.action_s for t in turns) if turns else 0.0,
            "added_latency_s": statistics.fmean(t.resume_s for t in turns) if turns else 0.0,
            "peak_mem_gb": max((b for _, b in self.mem_totals), default=0) / 1e9,
            "peak_live": self.peak_live,
        }

    # --- tables -----------------------------------------------------------------------------------

    def episode_table(self) -> Table:
        """One row per episode (narrow enough for 80 columns; the HTML report has every figure)."""
        t = Table(title=f"rollout episodes (pause_policy={self.pause_policy})", box=box.SIMPLE)
        for col in ("episode", "task", "from", "turns", "reward", "wall s", "run s", "wait s", "CPU s", "GB*s"):
            t.add_column(col, justify="left" if col in ("episode", "task", "from") else "right")
        for e in self.episodes:
            origin = f"{e.parent}@{e.branched_at}" if e.parent else ""
            reward = "[red]failed[/red]" if e.error else f"{e.reward:.2f}"
            t.add_row(e.id, e.task, origin, str(len(e.turns)), reward, f"{e.wall_s:.2f}", f"{e.running_s:.2f}",
                      f"{e.waiting_s:.2f}", f"{e.cpu_s:.3f}", f"{e.mem_gb_s:.3f}")
        return t

    def summary_rows(self) -> list[tuple[str, str, str, str]]:
        """(figure, this run, baseline "none" or "", ratio or "") for the totals that matter."""
        a = self.totals
        b = self.baseline.totals if self.baseline else None
        rows = []
        for key, label, fmt in SUMMARY:
            ratio = f"{a[key] / b[key]:.2f}x" if b is not None and key in RATIOS and b[key] else ""
            rows.append((label, fmt(a), fmt(b) if b is not None else "", ratio))
        return rows

    def summary_table(self) -> Table:
        t = Table(title=f"rollout totals: pause_policy={self.pause_policy}"
                        + (f", max_live={self.max_live}" if self.max_live else ""), box=box.SIMPLE)
        t.add_column("figure")
        t.add_column(self.pause_policy, justify="right")
        if self.baseline:
            t.add_column("none (same run)", justify="right")
            t.add_column("ratio", justify="right")
        for row in self.summary_rows():
            t.add_row(*(row if self.baseline else row[:2]))
        return t

    # --- files ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "pause_policy": self.pause_policy,
            "max_live": self.max_live,
            "totals": self.totals,
            "episodes": [e.to_json() for e in self.episodes],
            "mem_totals": self.mem_totals,
            "baseline": self.baseline.to_json() if self.baseline else None,
        }

    def to_html(self, path: str | Path) -> Path:
        """Write the HTML report (tables, inlined PNG plots, every episode's transcript); returns its path."""
        from k3sys.rollout.html import write_html

        return write_html(self, Path(path))


# (totals key, label, formatter of the totals) in the summary's order; RATIOS also get this run / baseline.
SUMMARY: list[tuple[str, str, Callable[[dict[str, float]], str]]] = [
    ("episodes", "episodes", lambda t: f"{t['episodes']:.0f}"),
    ("turns", "turns run", lambda t: f"{t['turns']:.0f}"),
    ("forks", "forks / prefix turns reused", lambda t: f"{t['forks']:.0f} / {t['prefix_turns_reused']:.0f}"),
    ("mean_reward", "mean reward", lambda t: f"{t['mean_reward']:.2f}"),
    ("wall_s", "wall time (s)", lambda t: f"{t['wall_s']:.1f}"),
    ("running_s", "sandboxes running (s)", lambda t: f"{t['running_s']:.1f}"),
    ("waiting_s", "waiting for the policy (s)", lambda t: f"{t['waiting_s']:.1f}"),
    ("waiting_frac", "waiting share of sandbox life", lambda t: f"{t['waiting_frac']:.0%}"),
    ("cpu_s", "CPU held by sandboxes (CPU*s)", lambda t: f"{t['cpu_s']:.2f}"),
    ("mem_gb_s", "memory held by sandboxes (GB*s)", lambda t: f"{t['mem_gb_s']:.3f}"),
    ("peak_mem_gb", "peak memory held (GB)", lambda t: f"{t['peak_mem_gb']:.3f}"),
    ("added_latency_s", "added latency per turn (ms)", lambda t: f"{t['added_latency_s'] * 1e3:.1f}"),
    ("errors", "failed episodes", lambda t: f"{t['errors']:.0f}"),
]
RATIOS = {"wall_s", "cpu_s", "mem_gb_s", "peak_mem_gb"}
