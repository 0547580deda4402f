"""Claims: the device planner (plan's default) plans + maps one rank's slots compiled on one CPU thread in
no more time than MoonEP's greedy (host plan + the same slot map) at E=896, R=64-256, with no host sync,
moving the lower bound of pairs; against the exact host oracle ("match") and the greedy (section
"planner"), with the passes each makes over `[R, E]`-sized tables and over the pairs beside the times.
And the simulated step time against static EP, EPLB and capacity-factor dropping across maxvio (section
"sim").

Section "planner": (R, E) in {(64, 896), (128, 896), (256, 896)}, K=16, s=4096, maxvio {1, 5, 20}:
plan + slot map + send/receive counts of rank 0 (`device_step`; for the host planners plan, slots,
traffic_of), eager and `torch.compile`d (inductor, fullgraph) on CPU, CUDA-graphed with --device cuda;
host syncs counted with `k3sys.ep.syncs.count_syncs`; passes = eager aten ops (views excluded) that read
or write an `[R, E]`-sized table (R*E to (R+1)*(E+1) entries) or the s*K pairs (`_Passes`; inductor
fuses the elementwise ones, so the compiled program makes fewer).

Sweep: E=896, K=16, s=4096 tokens per rank, R in {64, 128, 256}, maxvio in {0 ... 20}, hot_shift
{0, 0.5} (eplb plans from a past step; 0.5 moves half the experts' preferences in between), plus one
Zipf-preference routing. Cost model: `k3sys.ep.sim` defaults (H200 nodes of 8, prefetch overlapped with
dispatch on shared links, EPLB rebalanced every 100 steps); ours_tol uses the break-even tolerance.
Writes bench/results/ep_planner.json (a section not run keeps its old figures) and ep_planner.png.

    PYTHONPATH=src python bench/ep_planner.py [--quick] [--section planner|sim|all] [--device cuda --out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from _timing import median_ms
from k3sys.ep import make_routing, maxvio, plan, tokens_per_expert
from k3sys.ep.planner import device_plan, device_step
from k3sys.ep.sim import H200, K3_MOE, MOONEP, break_even_tolerance, compare
from k3sys.ep.syncs import count_syncs

RESULTS = Path(__file__).parent / "results"
EXPERTS, TOP_K, TOKENS = 896, 16, 4096
console = Console(width=200)
METHODS = ("static", "eplb", "capacity", "greedy", "ours", "ours_node", "ours_tol")
TOLERANCE = break_even_tolerance(4096, 16)
LABELS = {"eplb": "eplb (rebalanced every 100 steps)", "ours": "ours (exact)", "ours_node": "ours (exact, node-aware)",
          "ours_tol": f"ours (tolerance {TOLERANCE:.3f}, node-aware)"}


PLANNER_POINTS = [(R, mv) for R in (64, 128, 256) for mv in (1.0, 5.0, 20.0)]


class _Passes(TorchDispatchMode):
    """Counts the aten ops, views excluded, that read or write a tensor with `table` (lo, hi) entries
    (an `[R, E]`-sized table: [R, E], [E, R], [E + 1, R], [E * R]) and those with `pairs` entries (the
    s*K pairs: [n], [n, 2])."""

    def __init__(self, table: tuple[int, int], pairs: tuple[int, ...]) -> None:
        super().__init__()
        self.table, self.pairs, self.counts = table, pairs, {"table": 0, "pairs": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            sizes = [t.numel() for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.counts["table"] += any(self.table[0] <= n <= self.table[1] for n in sizes)
            self.counts["pairs"] += any(n in self.pairs for n in sizes)
        return out


def _passes(fn: Callable[[], object], R: int) -> dict[str, int]:
    """Passes of one eager call of `fn` over `[R, E]` tables and over the pairs (E=896, s*K=65,536)."""
    with _Passes((R * EXPERTS, (R + 1) * (EXPERTS + 1)), (TOKENS * TOP_K, 2 * TOKENS * TOP_K)) as counter:
        fn()
    return counter.counts


def _host_step(strategy: str) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """A host planner's per-step work on rank 0: plan, slot map, send/receive counts."""
    def step(tpe: torch.Tensor, ids_sk: torch.Tensor) -> object:
        p = plan(tpe, TOP_K, tokens_per_rank=TOKENS, strategy=strategy)
        return p.slots(0, ids_sk), p.traffic_of(0)
    return step


def _graphed(step: Callable, *args: object) -> Callable[[], object]:
    """`step(*args)` captured once in a CUDA graph (static inputs); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph's docs ask
        for _ in range(2):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*args)
    return graph.replay


def _timed(fns: dict[str, Callable[[], object]], repeats: int, cuda: bool) -> dict[str, float]:
    """Median ms of each of `fns` over `repeats` calls after one warm-up each, on one intra-op thread
    (CPU), the calls interleaved round-robin: a burst of load on the shared machine then hits every
    method alike instead of whichever was being timed."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if not cuda else before)
    times: dict[str, list[float]] = {name: [] for name in fns}
    try:
        for i in range(repeats + 1):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                if i:
                    times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def planner_section(
    repeats: int, device: str, ranks: tuple[int, ...], save: Callable[[list[dict]], None]
) -> list[dict]:
    """Plan + slot map time (median, one CPU thread on the host), moved / lower bound, copies and host
    syncs of the device planner (eager, compiled with inductor, and on CUDA CUDA-graphed) against the
    exact host oracle and MoonEP's greedy. `save` gets the rows after every point (a cut-off run keeps
    what it measured)."""
    cuda = device == "cuda"
    rows = []
    compiled: dict[int, Callable] = {}
    compile_s: dict[int, float] = {}
    for R, mv in ((R, mv) for R, mv in PLANNER_POINTS if R in ranks):
        ids = make_routing(R, TOKENS, EXPERTS, TOP_K, mv, seed=R)
        tpe, ids_sk = tokens_per_expert(ids, EXPERTS).to(device), ids[0].to(device)
        del ids
        args = (tpe, ids_sk, 0, TOP_K)
        fns: dict[str, Callable[[], object]] = {"device plan only": lambda t=tpe: device_plan(t, TOP_K),
                                                "device": lambda a=args: device_step(*a)}
        if cuda:  # the CUDA graph is the GPU's answer; inductor's Triton compiles would eat the lent minutes
            fns["device CUDA graph"] = _graphed(device_step, *args)
        else:
            if R not in compiled:
                t0 = time.perf_counter()
                compiled[R] = torch.compile(device_step, fullgraph=True, dynamic=False)
                compiled[R](*args)
                compile_s[R] = time.perf_counter() - t0
            fns["device compiled"] = lambda a=args, f=compiled[R]: f(*a)
        for strategy in ("match", "greedy"):
            fns[strategy] = lambda s=strategy, t=tpe, i=ids_sk: _host_step(s)(t, i)
        row = {"R": R, "maxvio_target": mv, "maxvio": maxvio(tpe.sum(0).cpu()), "compile_s": compile_s.get(R),
               "ms": {}, "syncs": {}, "passes": {}, "moved": {}, "copies": {}}
        row["ms"] = _timed(fns, repeats, cuda)
        for name, fn in fns.items():
            if name in ("device", "match", "greedy"):
                with count_syncs() as syncs:
                    fn()
                row["syncs"][name] = sum(syncs.values())
                row["passes"][name] = _passes(fn, R)
        for name, strategy in (("device", "device"), ("match", "match"), ("greedy", "greedy")):
            p = plan(tpe, TOP_K, tokens_per_rank=TOKENS, strategy=strategy)
            row["moved"][name], row["copies"][name] = p.moved_tokens, p.num_copies
        row["lower_bound"] = p.moved_lower_bound
        rows.append(row)
        save(rows)
        console.log(f"planner R={R} maxvio={mv}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items()))
    return rows


def print_planner(rows: list[dict]) -> None:
    names = list(rows[0]["ms"])
    fastest = "device CUDA graph" if "device CUDA graph" in names else "device compiled"
    table = Table(title=f"Plan + slot map + send/receive counts of one rank (E={EXPERTS}, K={TOP_K}, s={TOKENS}): "
                  "ms (median), passes over [R, E] tables and over the pairs (eager ops), host syncs, "
                  "moved / lower bound, copies")
    for col in ("R", "maxvio", *(f"ms {n}" for n in names), f"{fastest} / greedy", "[R,E] passes device/match/greedy",
                "pair passes device/match/greedy", "syncs device/match/greedy", "moved/LB device", "match", "greedy",
                "copies device", "match", "greedy"):
        table.add_column(col, justify="right")
    for r in rows:
        lb = max(r["lower_bound"], 1)
        table.add_row(
            str(r["R"]), f"{r['maxvio']:.2f}", *(f"{r['ms'][n]:.3f}" for n in names),
            f"{r['ms'][fastest] / r['ms']['greedy']:.2f}",
            *("/".join(str(r["passes"][n][kind]) for n in ("device", "match", "greedy"))
              for kind in ("table", "pairs")),
            "/".join(str(r["syncs"][n]) for n in ("device", "match", "greedy")),
            *(f"{r['moved'][n] / lb:.4f}" for n in ("device", "match", "greedy")),
            *(str(r["copies"][n]) for n in ("device", "match", "greedy")),
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="R=64 only, three maxvio points")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--section", choices=("planner", "sim", "all"), default="all")
    parser.add_argument("--device", default="cpu", help="where the planner section plans (cuda: CUDA graphs too)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the JSON")
    args = parser.parse_args()
    ranks = (64,) if args.quick else (64, 128, 256)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("ep_planner.json" if args.device == "cpu" else f"ep_planner_{args.device}.json")
    old = json.loads(path.read_text()) if path.exists() else {}
    planner_rows = old.get("planner", [])
    if args.section in ("planner", "all"):
        if args.device == "cuda" and not torch.cuda.is_available():
            console.print("no CUDA device: the planner section is skipped")
            return
        planner_meta = {
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
            "device": args.device, "note": "shared, noisy 2-core CPU; times are medians, one intra-op thread"}

        def save(rows: list[dict]) -> None:
            path.write_text(json.dumps(old | {"planner_meta": planner_meta, "planner": rows}, indent=1))

        planner_rows = planner_section(args.repeats, args.device, ranks, save)
        print_planner(planner_rows)
        ratios = [r["ms"]["device compiled"] / r["ms"]["greedy"] for r in planner_rows if "device compiled" in r["ms"]]
        if ratios:
            console.print(f"compiled device step / greedy step (target <= 1): {max(ratios):.2f} worst point, "
                          f"{statistics.median(ratios):.2f} median; host syncs of the device step: "
                          f"{sum(r['syncs']['device'] for r in planner_rows)}")
    if args.section == "planner":
        console.print(f"wrote {path}")
        return
    planner_meta = old.get("planner_meta") if args.section == "sim" else planner_meta
    maxvios = (0.0, 2.0, 20.0) if args.quick else (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
    points = [(R, mv, hs, "lognormal") for R in ranks for hs in (0.0, 0.5) for mv in maxvios]
    points.append((64, 14.0, 0.0, "zipf"))

    rows = []
    for R, mv, hs, dist in points:
        c = compare(mv, R, hot_shift=hs, dist=dist, tolerance=TOLERANCE)
        timing = {
            name: median_ms(lambda tpe=c.tpe, kw=kw: plan(tpe, 16, **kw), args.repeats, threads=1)
            for name, kw in (("greedy", {"strategy": "greedy"}), ("ours", {}),
                             ("ours_tol", {"tolerance": TOLERANCE, "ranks_per_node": H200.ranks_per_node}))
        }
        rows.append({"R": R, "maxvio_target": mv, "maxvio": c.maxvio, "hot_shift": hs, "dist": dist,
                     "methods": c.methods, "plan_ms": timing})
        console.log(f"R={R} maxvio={mv} hot_shift={hs} {dist}: done")

    step = Table(title="Simulated MoE layer step time / perfect balance (E=896, K=16, s=4096, H200 cost model)")
    for col in ("R", "prefs/shift", "maxvio", *METHODS, "capacity drop %"):
        step.add_column(col, justify="right")
    for r in rows:
        m = r["methods"]
        step.add_row(str(r["R"]), f"{r['dist'][:4]}/{r['hot_shift']:g}", f"{r['maxvio']:.2f}",
                     *(f"{m[k]['relative']:.3f}" for k in METHODS), f"{m['capacity']['dropped_pct']:.1f}")
    console.print(step)

    sched = Table(title="Prefetch schedule: step time / perfect balance with the replica weights sent after the "
                  "dispatch (serial) or with it (overlapped, sharing its links); lognormal, hot_shift 0")
    for col in ("R", "maxvio", "ours serial", "ours overlapped", "ours_node serial", "ours_node overlapped",
                "ours_tol serial", "ours_tol overlapped"):
        sched.add_column(col, justify="right")
    for r in rows:
        if r["hot_shift"] == 0 and r["dist"] == "lognormal":
            m = r["methods"]
            figures = (m[k][f] for k in ("ours", "ours_node", "ours_tol") for f in ("relative_serial", "relative"))
            sched.add_row(str(r["R"]), f"{r['maxvio']:.2f}", *(f"{v:.3f}" for v in figures))
    console.print(sched)

    quality = Table(title="Planner quality: moved tokens (pairs) and expert copies; plan time median of "
                    f"{args.repeats} (ms, this CPU)")
    for col in ("R", "prefs/shift", "maxvio", "moved LB", "moved greedy", "moved ours", "ratio",
                "copies greedy", "copies ours", "ratio", "copies node", f"copies tol{TOLERANCE:.3f}",
                "ms greedy", "ms ours", "ms tol"):
        quality.add_column(col, justify="right")
    for r in rows:
        g, o, n, t = (r["methods"][k] for k in ("greedy", "ours", "ours_node", "ours_tol"))
        quality.add_row(
            str(r["R"]), f"{r['dist'][:4]}/{r['hot_shift']:g}", f"{r['maxvio']:.2f}", f"{o['lower_bound']:,}",
            f"{g['moved_tokens']:,}", f"{o['moved_tokens']:,}", f"{o['moved_tokens'] / max(g['moved_tokens'], 1):.3f}",
            str(g["copies"]), str(o["copies"]), f"{o['copies'] / max(g['copies'], 1):.3f}", str(n["copies"]),
            str(t["copies"]),
            *(f"{r['plan_ms'][k]:.2f}" for k in ("greedy", "ours", "ours_tol")),
        )
    console.print(quality)

    worse = [r for r in rows if r["methods"]["ours"]["copies"] > r["methods"]["greedy"]["copies"]
             or r["methods"]["ours"]["moved_tokens"] > r["methods"]["greedy"]["moved_tokens"]]
    ms64 = [r["plan_ms"]["ours"] for r in rows if r["R"] == 64]
    console.print(f"points where ours moves or copies more than greedy: {len(worse)} of {len(rows)}; "
                  f"plan time at R=64 (target <= 2 ms): {statistics.median(ms64):.2f} ms typical (median over "
                  f"points of the per-point medians), {max(ms64):.2f} ms worst point")

    meta = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "note": "shared, noisy 2-core CPU; plan times are medians",
            "hardware": asdict(H200), "shape": asdict(K3_MOE), "schedule": asdict(MOONEP), "tolerance": TOLERANCE,
            "capacity_factor": 1.25}
    path.write_text(json.dumps({"meta": meta, "points": rows, "planner_meta": planner_meta,
                                "planner": planner_rows}, indent=1))
    plot(rows, ranks, args.out / "ep_planner.png")
    console.print(f"wrote {path} and {args.out / 'ep_planner.png'}")


def plot(rows: list[dict], ranks: tuple[int, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ranks), figsize=(5 * len(ranks), 4), sharey=True, squeeze=False)
    for ax, R in zip(axes[0], ranks, strict=True):
        for hs, style in ((0.0, "-"), (0.5, "--")):
            pts = sorted((r for r in rows if r["R"] == R and r["hot_shift"] == hs and r["dist"] == "lognormal"),
                         key=lambda r: r["maxvio"])
            for i, name in enumerate(METHODS):
                if hs and name not in ("eplb",):
                    continue  # only eplb depends on the stale statistics
                label = LABELS.get(name, name) if not hs else f"{name} (stale, shift 0.5)"
                ax.plot([r["maxvio"] for r in pts], [r["methods"][name]["relative"] for r in pts], style,
                        color=f"C{i}", marker="o", ms=3, label=label)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_title(f"R = {R}")
        ax.set_xlabel("maxvio (realised)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("step time / perfect balance")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Simulated K3 MoE layer step (E=896, K=16, s=4096; capacity drops tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
