"""`k3sys demo` part "Rollout": the tiny hybrid model drives agent episodes in real sandboxes, which
are paused while it thinks, beside the same episodes with no pausing and with hibernation; GRPO-style
groups of 2 forked after the first turn. Writes the HTML report of pause vs none (its path is the
tour's last line)."""

from __future__ import annotations

from pathlib import Path

from rich.progress import Progress

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.templates import template_rootfs

EPISODES, TURNS, GROUP, BRANCH_AT, NEW_TOKENS = 3, 3, 2, 1, 128
REPORT = Path("k3sys-demo-rollout.html")


def demo(progress: Progress) -> list[tuple[str, str]]:
    missing = system_paths().missing()
    if missing:
        return [("skipped", missing)]
    from k3sys.rollout import ModelPolicy, RolloutEngine, builtin_tasks

    tasks = builtin_tasks()
    try:
        template_rootfs("debian", build=False)
    except DriverError:  # building it takes minutes and the network: leave fix-test out of a quick tour
        tasks = [t for t in tasks if t.template != "debian"]
    turns = EPISODES * (TURNS + (GROUP - 1) * (TURNS - BRANCH_AT))
    bar = progress.add_task("rollout: tiny model thinks; sandboxes paused, unpaused, hibernated", total=3 * turns)
    policy = ModelPolicy(new_tokens=NEW_TOKENS)
    kw = {"group": GROUP, "branch_at": BRANCH_AT, "on_turn": lambda *_: progress.advance(bar)}
    report = RolloutEngine(policy, pause_policy="pause").run(tasks, EPISODES, TURNS, compare_none=True, **kw)
    hibernated = RolloutEngine(policy, pause_policy="hibernate").run(tasks, EPISODES, TURNS, **kw)
    path = report.to_html(REPORT).resolve()
    p, n, h = report.totals, report.baseline.totals, hibernated.totals
    return [
        ("episodes", f"{p['episodes']:.0f} ({p['forks']:.0f} forks, {p['prefix_turns_reused']:.0f} prefix turns "
                     f"reused), {', '.join(sorted({t.name for t in tasks}))}"),
        ("mean reward / failed episodes", f"{p['mean_reward']:.2f} / {p['errors'] + n['errors'] + h['errors']:.0f}"),
        ("policy think time (tiny model, queued)", f"{p['think_s_per_turn'] * 1e3:.0f} ms/turn"),
        ("waiting share of sandbox life", f"{p['waiting_frac']:.0%}"),
        ("CPU held by sandboxes: pause / none", f"{p['cpu_s']:.2f} / {n['cpu_s']:.2f} CPU*s "
                                                f"({p['cpu_s'] / n['cpu_s']:.2f}x)"),
        ("memory held: hibernate / none", f"{h['mem_gb_s']:.3f} / {n['mem_gb_s']:.3f} GB*s "
                                          f"({h['mem_gb_s'] / n['mem_gb_s']:.2f}x; pause keeps it: "
                                          f"{p['mem_gb_s'] / n['mem_gb_s']:.2f}x)"),
        ("added latency per turn: pause / hibernate", f"{p['added_latency_s'] * 1e3:.1f} / "
                                                      f"{h['added_latency_s'] * 1e3:.0f} ms"),
        ("report", str(path)),
    ]
