"""What sleeping sandboxes save in agent-RL rollouts: pause_policy none / pause / hibernate / auto.

For think/act ratios {1, 10, 50} (think time = ratio x the measured median action time; the task
suite's actions take tens of ms here, so even ratio 50 keeps the sweep to a few minutes), the same
episodes (built-in tasks, each sandbox running a 64 MiB agent service that polls /work every 100 ms)
run once per policy, sequentially, `--repeats` times. Per run, from the sandboxes' cgroup counters:
resident GB-seconds and CPU-seconds held, and the latency resuming adds per turn. Medians over repeats.

Density (episodes that fit in 8 GiB): a sandbox needs, on average, its time-averaged resident memory
over its turns (cgroup memory samples integrated from the end of setup to the end of its last action),
plus under hibernation the CRIU images staged on tmpfs while a dump is in flight (counted as the
sandbox's peak resident size for its time in "hibernating"). With `max_live` admitting sandboxes
against the budget, episodes = 8 GiB / that average (Little's law: the budget holds the average
number of resident sandboxes, not the peak of each). For "none" the average is the resident size
itself: every sandbox stays resident. A last run checks the lever for real: 8
episodes at ratio 50 with max_live=2 and hibernate vs none, peak memory measured.

    python bench/rollout.py [--repeats 2] [--episodes 3] [--turns 3]

Writes bench/results/rollout.json and rollout.png. Needs root, runc and our CRIU build
(scripts/install-sandbox.sh) and the `debian` template (built on first use).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3sys.rollout import (
    EpisodeRecord,
    RolloutEngine,
    RolloutReport,
    ScriptedPolicy,
    builtin_tasks,
    default_factory,
)
from k3sys.sandbox import Runtime

RESULTS = Path(__file__).resolve().parent / "results"
RATIOS = (1, 10, 50)
POLICIES = ("none", "pause", "hibernate", "auto")
BUDGET = 8 << 30  # bytes
RESIDENT_MB, POLL_MS = 64, 100


def held_bytes(e: EpisodeRecord) -> float:
    """Time-averaged bytes `e` held over its turns (setup and the final reward check left out: they
    are the same under every policy), tmpfs staging of in-flight dumps included (see the docstring)."""
    t0 = next(end for state, _, end in e.intervals if state == "setup")
    last = e.turns[-1]
    t1 = last.think_start + last.think_s + last.resume_s + last.action_s

    def inside(a: float, b: float) -> float:
        return max(0.0, min(b, t1) - max(a, t0))

    # Each memory sample holds until the next one (the sampler's own rule).
    byte_s = sum(m * inside(a, b) for (a, m), (b, _) in itertools.pairwise([*e.mem_series, (math.inf, 0)]))
    staged_s = sum(inside(a, b) for state, a, b in e.intervals if state == "hibernating")
    return (byte_s + staged_s * e.peak_mem_bytes) / (t1 - t0)


def measure(report: RolloutReport) -> dict:
    t = report.totals
    eps = report.episodes
    per_ep = [held_bytes(e) for e in eps]
    suspends = [turn.suspend for e in eps for turn in e.own_turns]
    spans = {k: [b - a for e in eps for state, a, b in e.intervals if state == k] for k in ("hibernating", "resuming")}
    return {
        "mem_gb_s": t["mem_gb_s"], "cpu_s": t["cpu_s"], "added_latency_ms": t["added_latency_s"] * 1e3,
        "wall_s": t["wall_s"], "waiting_frac": t["waiting_frac"], "mean_reward": t["mean_reward"],
        "errors": t["errors"], "peak_mem_gb": t["peak_mem_gb"],
        "avg_bytes_per_episode": statistics.fmean(per_ep),
        "peak_bytes_per_episode": statistics.fmean(e.peak_mem_bytes for e in eps),
        "hibernated_turns": suspends.count("hibernate") / max(len(suspends), 1),
        # Seconds per hibernation (freeze + dump + store + stop) and per resume (thaw or restore).
        "hibernate_s": statistics.median(spans["hibernating"]) if spans["hibernating"] else None,
        "resume_s": statistics.median(spans["resuming"]) if spans["resuming"] else None,
    }


def run(rt: Runtime, policy: str, think_ms: float, args: argparse.Namespace, seed: int,
        max_live: int | None = None, episodes: int | None = None) -> dict:
    tasks = builtin_tasks(seed, RESIDENT_MB, POLL_MS)
    engine = RolloutEngine(ScriptedPolicy(think_ms, "lognormal", spread=0.25, seed=seed), default_factory(rt),
                           pause_policy=policy, max_live=max_live)
    report = engine.run(tasks, episodes or args.episodes, args.turns, seed=seed)
    if report.errors:
        raise RuntimeError(f"{policy} @ {think_ms:.0f} ms: failed episodes {report.errors}")
    return measure(report)


def median_of(runs: list[dict]) -> dict:
    """Per key, the median over repeats (None where a run had nothing to measure)."""
    return {k: statistics.median(r[k] for r in runs) if all(r[k] is not None for r in runs) else None
            for k in runs[0]}


def plot(results: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.6))
    panels = [("mem_gb_s", "memory held (GB*s)"), ("cpu_s", "CPU held (CPU*s)"),
              ("added_latency_ms", "added latency per turn (ms)")]
    colors = {"none": "#4c72b0", "pause": "#dd8452", "hibernate": "#9e9e9e", "auto": "#2ca02c"}
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 4, i + 1)
        for j, pol in enumerate(POLICIES):
            ys = [results["sweep"][str(r)][pol][key] for r in RATIOS]
            ax.bar([k + (j - 1.5) * 0.2 for k in range(len(RATIOS))], ys, 0.2, color=colors[pol], label=pol)
        ax.set_xticks(range(len(RATIOS)), [f"think/act {r}" for r in RATIOS], fontsize=8)
        ax.set_title(title, fontsize=10)
        if i == 0:
            ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 4, 4)
    d = results["density"]
    for j, pol in enumerate(("none", "hibernate", "auto")):
        ax.bar([k + (j - 1) * 0.27 for k in range(len(RATIOS))], [d[str(r)][pol] for r in RATIOS], 0.27,
               color=colors[pol], label=pol)
    ax.set_xticks(range(len(RATIOS)), [f"think/act {r}" for r in RATIOS], fontsize=8)
    ax.set_title("episodes that fit in 8 GiB", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    console = Console(width=150)
    t_start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="k3sys-bench-rollout-"))
    try:
        with Runtime(root) as rt:
            try:
                results = sweep_all(rt, args, console, t_start)
            finally:
                rt.kill_all()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rollout.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "rollout.png")
    console.print(f"wrote {RESULTS / 'rollout.json'} and rollout.png in {results['bench_wall_s']:.0f} s")


def sweep_all(rt: Runtime, args: argparse.Namespace, console: Console, t_start: float) -> dict:
    # Action time: the same suite with no thinking and no pausing.
    calib = RolloutEngine(ScriptedPolicy(0.0, "fixed"), default_factory(rt), pause_policy="none").run(
        builtin_tasks(0, RESIDENT_MB, POLL_MS), args.episodes, args.turns)
    action_ms = statistics.median(t.action_s for e in calib.episodes for t in e.own_turns) * 1e3
    console.print(f"median action time {action_ms:.1f} ms over {calib.totals['turns']:.0f} turns")

    runs: dict[str, dict[str, list[dict]]] = {str(r): {p: [] for p in POLICIES} for r in RATIOS}
    for rep in range(args.repeats):
        for r in RATIOS:
            for pol in POLICIES:  # interleaved: machine noise spreads over every policy alike
                runs[str(r)][pol].append(run(rt, pol, r * action_ms, args, seed=rep))
                console.print(f"  repeat {rep} ratio {r:>2} {pol:<9} {runs[str(r)][pol][-1]['wall_s']:.1f} s")
    sweep = {r: {p: median_of(v) for p, v in pols.items()} for r, pols in runs.items()}
    density = {r: {p: int(BUDGET // sweep[r][p]["avg_bytes_per_episode"]) for p in POLICIES} for r in sweep}

    # The lever itself: 8 episodes at ratio 50, at most 2 live, hibernating vs no cap and no pausing.
    lever = {pol: run(rt, pol, 50 * action_ms, args, seed=0, max_live=cap, episodes=8)
             for pol, cap in (("none", None), ("hibernate", 2))}

    table = Table(title=f"rollout: {args.episodes} episodes x {args.turns} turns, {RESIDENT_MB} MiB agent service, "
                        f"median action {action_ms:.0f} ms, medians of {args.repeats}")
    for col in ("think/act", "think ms", "policy", "mem GB*s", "x none", "CPU*s", "x none", "added ms/turn",
                "hibernated turns", "avg MB/episode", "fit in 8 GiB"):
        table.add_column(col, justify="right")
    for r in RATIOS:
        base = sweep[str(r)]["none"]
        for pol in POLICIES:
            m = sweep[str(r)][pol]
            table.add_row(str(r), f"{r * action_ms:.0f}", pol, f"{m['mem_gb_s']:.3f}",
                          f"{m['mem_gb_s'] / base['mem_gb_s']:.2f}", f"{m['cpu_s']:.2f}",
                          f"{m['cpu_s'] / base['cpu_s']:.2f}", f"{m['added_latency_ms']:.1f}",
                          f"{m['hibernated_turns']:.0%}", f"{m['avg_bytes_per_episode'] / 1e6:.1f}",
                          str(density[str(r)][pol]))
    console.print(table)
    hib = [sweep[str(r)]["hibernate"] for r in RATIOS]
    console.print(f"hibernate: median {statistics.median(m['hibernate_s'] for m in hib) * 1e3:.0f} ms per dump, "
                  f"{statistics.median(m['resume_s'] for m in hib) * 1e3:.0f} ms per restore ({args.episodes} at once)")
    ln, lh = lever["none"], lever["hibernate"]
    console.print(f"max_live lever, 8 episodes at think/act 50: peak memory {lh['peak_mem_gb'] * 1e3:.0f} MB "
                  f"(hibernate, max_live=2) vs {ln['peak_mem_gb'] * 1e3:.0f} MB (none); wall {lh['wall_s']:.1f} s "
                  f"vs {ln['wall_s']:.1f} s")

    return {
        "config": {"episodes": args.episodes, "turns": args.turns, "repeats": args.repeats, "ratios": RATIOS,
                   "resident_mb": RESIDENT_MB, "poll_ms": POLL_MS, "action_ms": action_ms,
                   "think_ms": {str(r): r * action_ms for r in RATIOS}, "budget_bytes": BUDGET,
                   "host": platform.node(), "kernel": platform.release()},
        "sweep": sweep, "density": density, "lever": lever, "runs": runs,
        "bench_wall_s": time.perf_counter() - t_start,
    }


if __name__ == "__main__":
    main()
