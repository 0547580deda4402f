"""`k3sys demo` part "Rollout": the tiny hybrid model drives agent episodes in real sandboxes, which
are paused while it thinks, beside the same episodes with no pausing; GRPO-style groups of 2 forked
after the first turn. Writes the HTML report (its path is the tour's last line)."""

from __future__ import annotations

from pathlib import Path

from rich.progress import Progress

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.system import system_paths
from k3sys.sandbox.templates import template_rootfs

EPISODES, TURNS, GROUP, BRANCH_AT, NEW_TOKENS = 3, 3, 2, 1, 128
REPORT = Path("k3sys-demo-rollout.html")


def demo(progress: Progress) -> list[tuple[str, str]]:
    missing = system_paths().missing()
    if missing:
        return [("skipped", missing)]
    from k3sys.sandbox.rollout import ModelPolicy, RolloutEngine, builtin_tasks

    tasks = builtin_tasks()
    try:
        template_rootfs("debian", build=False)
    except DriverError:  # building it takes minutes and the network: leave fix-test out of a quick tour
        tasks = [t for t in tasks if t.template != "debian"]
    bar = progress.add_task("rollout: tiny model thinks, sandboxes paused (then the same unpaused)",
                            total=2 * EPISODES * (TURNS + (GROUP - 1) * (TURNS - BRANCH_AT)))
    engine = RolloutEngine(ModelPolicy(new_tokens=NEW_TOKENS), pause_policy="pause")
    report = engine.run(tasks, EPISODES, TURNS, group=GROUP, branch_at=BRANCH_AT, compare_none=True,
                        on_turn=lambda *_: progress.advance(bar))
    path = report.to_html(REPORT).resolve()
    a, b = report.totals, report.baseline.totals
    return [
        ("episodes", f"{a['episodes']:.0f} ({a['forks']:.0f} forks, {a['prefix_turns_reused']:.0f} prefix turns "
                     f"reused), {', '.join(sorted({t.name for t in tasks}))}"),
        ("mean reward / failed episodes", f"{a['mean_reward']:.2f} / {a['errors'] + b['errors']:.0f}"),
        ("policy think time (tiny model, queued)", f"{a['think_s_per_turn'] * 1e3:.0f} ms/turn"),
        ("waiting share of sandbox life", f"{a['waiting_frac']:.0%}"),
        ("CPU held by sandboxes, pause vs none", f"{a['cpu_s']:.2f} vs {b['cpu_s']:.2f} CPU*s "
                                                 f"({a['cpu_s'] / b['cpu_s']:.2f}x)"),
        ("memory held, pause vs none (pause keeps it)", f"{a['mem_gb_s']:.3f} vs {b['mem_gb_s']:.3f} GB*s "
                                                        f"({a['mem_gb_s'] / b['mem_gb_s']:.2f}x)"),
        ("added latency per turn (resume)", f"{a['added_latency_s'] * 1e3:.1f} ms"),
        ("report", str(path)),
    ]
