"""`k3sys demo` EP part: the planner's balance at K3 scale, then the runtime on 2 local gloo ranks."""

from __future__ import annotations

from rich.progress import Progress

from k3sys.ep.measure import StepSetup, measure_step
from k3sys.ep.sim import compare

MAXVIOS = (2.0, 10.0)
# Small enough for a few seconds per method on 2 shared cores; hot experts all on rank 0.
RUNTIME = StepSetup(experts=16, top_k=2, hidden=256, ffn=512, tokens=1024, maxvio=5.0, placement="rank0",
                    steps=5, warmup=2)


def demo(progress: Progress) -> list[tuple[str, str]]:
    task = progress.add_task("EP: K3-scale planner, 2-rank runtime", total=len(MAXVIOS) + 1)
    rows = []
    for maxvio in MAXVIOS:
        m = compare(maxvio, 64).methods
        static, ours, tol = m["static"], m["ours"], m["ours_tol"]
        rows.append((f"K3 MoE (E=896, K=16, R=64), maxvio {maxvio:g}: balancedness",
                     f"static {static['balancedness']:.2f} -> ours {ours['balancedness']:.2f} "
                     f"({ours['copies']} copies, {ours['moved_tokens']} moved = lower bound "
                     f"{ours['lower_bound']})"))
        rows.append((f"K3 MoE, maxvio {maxvio:g}: modeled H200 step",
                     f"static {static['step_ms']:.1f} ms -> ours {ours['step_ms']:.1f} ms exact, "
                     f"{tol['step_ms']:.1f} ms within the break-even tolerance"))
        progress.advance(task)
    times = measure_step(RUNTIME)  # both methods, taking turns step by step
    progress.advance(task)
    base, ours = times["baseline"], times["ours"]
    rows.append((f"2 gloo ranks, maxvio {RUNTIME.maxvio:g} hot on rank 0: fwd+bwd",
                 f"plain EP {base['time_s'] * 1e3:.0f} ms (max/mean load {base['max_over_mean_load']:.2f}) "
                 f"-> ours {ours['time_s'] * 1e3:.0f} ms ({base['time_s'] / ours['time_s']:.2f}x)"))
    return rows
