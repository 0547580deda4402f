"""Claim: the balanced EP runtime keeps an MoE layer's step time flat as routing skew grows, while plain
all_to_all expert parallelism (no replicas, what DeepEP does) slows down with its hottest rank.

2 gloo ranks (mp.spawn), one thread each; MoELayer E=64, K=4, H=256, ffn 512, s=2048 tokens per rank;
maxvio in {0, 1, 2, 5, 10}, with the hot experts where the routing puts them ("spread") and all on rank
0 ("rank0"). Both methods run the same layer and EPBuffer code: ours with the planner's exact caps,
the baseline with balancing off (planner tolerance R - 1: every pair on its expert's home rank, no
replicas). Per point (`k3sys.ep.measure`): fwd+bwd time of the routed experts, median over 20 steps
after 3 warm-up steps, each step timed by its slowest rank, a fresh routing per step from the same
distribution, the two methods taking turns step by step in the same processes, freed memory kept in
the processes as a caching allocator would (`--malloc cache`, see `k3sys.ep.measure.MALLOC_ENV`); the
busiest rank's CPU time per step (less sensitive than wall time to other load on a shared machine);
the baseline's max/mean rank load; each method's peak RSS from its own fresh processes (max over
ranks); and the load average before and after each point.

Targets (issue 4): ours within 15% of its maxvio-0 time; ours' speedup over the baseline >= 0.9 x the
baseline's max/mean load; ours' peak memory the same at every maxvio.

    PYTHONPATH=src python bench/ep_runtime.py [--steps 20] [--maxvio 0 1 2 5 10] [--malloc cache]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3sys.ep.measure import MALLOC_ENV, METHODS, StepSetup, measure_step

OUT = Path(__file__).parent / "results"


def plot(rows: list[dict], setup: StepSetup, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r, ax_m) = plt.subplots(1, 3, figsize=(16, 4))
    for placement, style in (("spread", "-"), ("rank0", "--")):
        pts = [r for r in rows if r["placement"] == placement]
        vio = [r["maxvio"] for r in pts]
        ax_t.plot(vio, [r["ours"]["time_s"] * 1e3 for r in pts], "o" + style, color="C0",
                  label=f"ours, hot {placement}")
        ax_t.plot(vio, [r["baseline"]["time_s"] * 1e3 for r in pts], "s" + style, color="C3",
                  label=f"plain all_to_all EP, hot {placement}")
        ax_r.plot(vio, [r["speedup"] for r in pts], "o" + style, color="C0", label=f"speedup, hot {placement}")
        ax_r.plot(vio, [r["baseline"]["max_over_mean_load"] for r in pts], "x" + style, color="0.4",
                  label=f"baseline max/mean load, hot {placement}")
        for method, color, marker in (("ours", "C0", "o"), ("baseline", "C3", "s")):
            ax_m.plot(vio, [r[method]["peak_rss_mib"] for r in pts], marker + style, color=color,
                      label=f"{method}, hot {placement}")
    ax_t.set(xlabel="maxvio", ylabel="fwd+bwd step time (ms)",
             title=f"MoE layer, {setup.ranks} gloo ranks, E={setup.experts} K={setup.top_k}")
    ax_r.set(xlabel="maxvio", ylabel="x", title="speedup over plain EP vs the gain balance can give")
    ax_m.set(xlabel="maxvio", ylabel="MiB", title="peak RSS per rank process (max over ranks)")
    for ax in (ax_t, ax_r, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--maxvio", type=float, nargs="+", default=[0, 1, 2, 5, 10])
    parser.add_argument("--malloc", choices=list(MALLOC_ENV), default="cache", help="allocator settings for timing")
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 170)  # logs get the whole table
    base = StepSetup(steps=args.steps)
    rows = []
    for placement in ("spread", "rank0"):
        for maxvio in args.maxvio:
            setup = replace(base, maxvio=maxvio, placement=placement)
            load_before = os.getloadavg()[0]
            row = {"placement": placement, "maxvio": maxvio, **measure_step(setup, malloc=args.malloc)}
            for method in METHODS:  # memory: each method alone in fresh processes
                alone = measure_step(replace(setup, steps=3, warmup=1), [method], malloc="release")
                row[method]["peak_rss_mib"] = alone[method]["peak_rss_mib"]
                console.log(f"hot {placement}, maxvio {maxvio:g}, {method}: {row[method]}")
            row["speedup"] = row["baseline"]["time_s"] / row["ours"]["time_s"]
            row["loadavg_1min"] = [load_before, os.getloadavg()[0]]
            rows.append(row)

    table = Table(title=f"EP runtime, fwd+bwd: {base.ranks} gloo ranks x 1 thread, E={base.experts} K={base.top_k} "
                        f"H={base.hidden} ffn={base.ffn} s={base.tokens}")
    for col in ("hot experts", "maxvio", "baseline max/mean load", "baseline ms", "ours ms", "speedup",
                "speedup / load", "ours / ours@vio0", "busiest-rank CPU ms base / ours", "CPU speedup / load",
                "copies", "peak RSS MiB ours / base", "load avg"):
        table.add_column(col, justify="right")
    for r in rows:
        flat = next(x for x in rows if x["placement"] == r["placement"] and x["maxvio"] == min(args.maxvio))
        table.add_row(
            r["placement"], f"{r['maxvio']:g}", f"{r['baseline']['max_over_mean_load']:.2f}",
            f"{r['baseline']['time_s'] * 1e3:.0f}", f"{r['ours']['time_s'] * 1e3:.0f}", f"{r['speedup']:.2f}x",
            f"{r['speedup'] / r['baseline']['max_over_mean_load']:.2f}",
            f"{r['ours']['time_s'] / flat['ours']['time_s']:.2f}",
            f"{r['baseline']['cpu_s'] * 1e3:.0f} / {r['ours']['cpu_s'] * 1e3:.0f}",
            f"{r['baseline']['cpu_s'] / r['ours']['cpu_s'] / r['baseline']['max_over_mean_load']:.2f}",
            f"{r['ours']['copies']:.1f}", f"{r['ours']['peak_rss_mib']:.0f} / {r['baseline']['peak_rss_mib']:.0f}",
            "{:.1f}-{:.1f}".format(*r["loadavg_1min"]),
        )
    console.print(table)
    OUT.mkdir(exist_ok=True)
    config = asdict(base) | {"threads_per_rank": 1, "backend": "gloo", "maxvio": args.maxvio, "malloc": args.malloc}
    (OUT / "ep_runtime.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    plot(rows, base, OUT / "ep_runtime.png")
    console.print(f"wrote {OUT / 'ep_runtime.json'} and {OUT / 'ep_runtime.png'}")


if __name__ == "__main__":
    main()
