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

Part "model" (issue 17): the hybrid model (tiny preset widened, see MODEL) under `apply_ep` on 2 gloo
ranks x 1 thread, each rank its own batch, against one process (1 thread) running both ranks' batches
and one rank's batch: forward and training-step time (fwd + bwd + the data-parallel all-reduce of the
replicated gradients + SGD), medians over steps, the EP variants taking turns step by step; and the
overlap's saving: async dispatch (the shared expert runs while the tokens travel) against the same
model waiting for the tokens first, as the median of the per-step differences.

    PYTHONPATH=src python bench/ep_runtime.py [--part layer model] [--steps 20] [--maxvio 0 1 2 5 10]
                                              [--malloc cache] [--model-steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from k3sys.ep import EPBuffer, ExpertParallelMoE, apply_ep
from k3sys.ep.layer import SwiGLU
from k3sys.ep.measure import MALLOC_ENV, METHODS, StepSetup, measure_step
from k3sys.model import HybridModel, ModelConfig

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


# The tiny preset (KDA + gated MLA, first layer dense, 3 MoE layers with E=8, K=2) widened so that the
# shared expert and the token rows are not negligible: hidden 256, experts on the full hidden state.
MODEL = {"hidden_size": 256, "moe_latent_size": None, "expert_ffn_size": 256, "num_shared_experts": 2,
         "dense_ffn_size": 512}
BATCH, SEQ, RANKS, LR = 4, 128, 2, 0.01
EP_METHODS = {"ep_async": True, "ep_sync": False}  # name -> async_dispatch


def _batch(rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))


def _train_step(model: HybridModel, opt: torch.optim.Optimizer, ids: torch.Tensor,
                group: dist.ProcessGroup | None) -> tuple[float, float]:
    """One fwd + bwd (+ all-reduce of the replicated gradients under EP) + SGD step: (fwd s, step s)."""
    t0 = time.perf_counter()
    logits = model(ids[:, :-1])
    t1 = time.perf_counter()
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").backward()
    if group is not None:
        experts = {id(getattr(m, n)) for m in model.modules() if isinstance(m, ExpertParallelMoE)
                   for n in ("w_gate", "w_up", "w_down")}
        grads = [p.grad for p in model.parameters() if id(p) not in experts]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce, as DDP's buckets would
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, time.perf_counter() - t0


def _model_worker(rank: int, port: int, steps: int, warmup: int, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS,
                            timeout=timedelta(minutes=10))
    cfg = ModelConfig.from_preset("tiny", **MODEL)
    runs = {}
    for name, overlap in EP_METHODS.items():
        torch.manual_seed(0)
        model = apply_ep(HybridModel(cfg), dist.group.WORLD, BATCH * SEQ, async_dispatch=overlap)
        runs[name] = (model, torch.optim.SGD(model.parameters(), lr=LR))
    ids = _batch(rank, cfg.vocab_size)
    rec = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name in runs if i % 2 == 0 else list(runs)[::-1]:
            dist.barrier()
            times = torch.tensor(_train_step(*runs[name], ids, dist.group.WORLD), dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
            if i >= warmup:
                rec[name].append(times.tolist())
    probe = _overlap_probe(rank, steps)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"model": rec, "probe": probe}))
    dist.destroy_process_group()


# The overlap in isolation, sized so the token transfer is not lost in the noise: one EPBuffer
# dispatch of 2048 tokens x K=4 x H=1024 fp32 (32 MiB out of each rank) and a shared expert of width 256.
PROBE = {"tokens": 2048, "hidden": 1024, "top_k": 4, "experts": 8, "shared_ffn": 256}


def _overlap_probe(rank: int, steps: int) -> dict[str, list[float]]:
    """Per step (s, slowest rank): dispatch alone, shared expert alone, both with a synchronous
    dispatch, both with the shared expert between an async dispatch and its wait()."""
    c = PROBE
    buf = EPBuffer(dist.group.WORLD, c["tokens"], c["hidden"], c["top_k"], c["experts"])
    torch.manual_seed(rank)
    shared = SwiGLU(c["hidden"], c["shared_ffn"])
    x = torch.randn(c["tokens"], c["hidden"])
    ids = torch.stack([torch.randperm(c["experts"])[: c["top_k"]] for _ in range(c["tokens"])])
    w = torch.rand(c["tokens"], c["top_k"])

    def overlapped() -> None:
        pending = buf.dispatch(x, ids, w, async_op=True)
        shared(x)
        pending.wait()

    cases = {"dispatch": lambda: buf.dispatch(x, ids, w), "shared": lambda: shared(x),
             "sync": lambda: (buf.dispatch(x, ids, w), shared(x)), "async": overlapped}
    rec: dict[str, list[float]] = {name: [] for name in cases}
    with torch.no_grad():
        for i in range(steps + 2):
            for name in cases if i % 2 == 0 else list(cases)[::-1]:
                dist.barrier()
                t0 = time.perf_counter()
                cases[name]()
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i >= 2:
                    rec[name].append(float(elapsed))
    return rec


def _single_process(tokens_of: int, steps: int, warmup: int) -> list[list[float]]:
    """(fwd s, step s) per step of one process (1 thread) on the batches of `tokens_of` ranks."""
    torch.set_num_threads(1)
    cfg = ModelConfig.from_preset("tiny", **MODEL)
    torch.manual_seed(0)
    model = HybridModel(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids = torch.cat([_batch(r, cfg.vocab_size) for r in range(tokens_of)])
    return [_train_step(model, opt, ids, None) for _ in range(warmup + steps)][warmup:]


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def model_part(steps: int, warmup: int, console: Console) -> dict:
    """The hybrid model under EP on 2 ranks vs one process; async vs synchronous dispatch."""
    load = [_uptime()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(_model_worker, args=(port, steps, warmup, f.name), nprocs=RANKS)
        got = json.loads(Path(f.name).read_text())
    ep, probe = got["model"], got["probe"]
    load.append(_uptime())
    raw = {"single_all": _single_process(RANKS, steps, warmup), "single_one_rank": _single_process(1, steps, warmup),
           **ep}
    load.append(_uptime())
    out = {name: {"fwd_ms": 1e3 * statistics.median(t[0] for t in ts),
                  "step_ms": 1e3 * statistics.median(t[1] for t in ts)} for name, ts in raw.items()}
    pairs = list(zip(ep["ep_sync"], ep["ep_async"], strict=True))
    out["overlap_saving_ms"] = {"fwd_ms": 1e3 * statistics.median(s[0] - a[0] for s, a in pairs),
                                "step_ms": 1e3 * statistics.median(s[1] - a[1] for s, a in pairs)}
    config = {"preset": "tiny", **MODEL, "batch_per_rank": BATCH, "seq": SEQ, "ranks": RANKS, "threads": 1,
              "steps": steps, "warmup": warmup}
    table = Table(title=f"Hybrid model (tiny preset, hidden 256, E=8 K=2, 2 shared experts), {BATCH}x{SEQ} tokens "
                        f"per rank, fwd + bwd + SGD, 1 thread per process")
    for col in ("run", "tokens / process", "fwd ms", "step ms", "step / single (all tokens)"):
        table.add_column(col, justify="right")
    labels = {"single_all": ("1 process, both ranks' batches", 2),
              "single_one_rank": ("1 process, one rank's batch", 1),
              "ep_async": ("EP 2 ranks, async dispatch (overlap)", 1), "ep_sync": ("EP 2 ranks, sync dispatch", 1)}
    for name, (label, n) in labels.items():
        table.add_row(label, str(n * BATCH * SEQ), f"{out[name]['fwd_ms']:.0f}", f"{out[name]['step_ms']:.0f}",
                      f"{out[name]['step_ms'] / out['single_all']['step_ms']:.2f}")
    table.add_row("overlap saving (sync - async, median of per-step differences)", "",
                  f"{out['overlap_saving_ms']['fwd_ms']:.1f}", f"{out['overlap_saving_ms']['step_ms']:.1f}", "")
    console.print(table)
    probe_ms = {name: 1e3 * statistics.median(ts) for name, ts in probe.items()}
    saving = 1e3 * statistics.median(s - a for s, a in zip(probe["sync"], probe["async"], strict=True))
    probe_ms["saving_paired"] = saving
    probe_ms["saving_of_bound"] = saving / min(probe_ms["dispatch"], probe_ms["shared"])
    table = Table(title=f"Overlap probe: EPBuffer dispatch of {PROBE['tokens']} tokens x K={PROBE['top_k']} x "
                        f"H={PROBE['hidden']} fp32 and a shared expert (width {PROBE['shared_ffn']}), 2 gloo ranks")
    for col in ("dispatch alone ms", "shared alone ms", "sync: dispatch then shared ms",
                "async: shared during dispatch ms", "saving ms (paired median)", "saving / min(dispatch, shared)"):
        table.add_column(col, justify="right")
    table.add_row(*(f"{probe_ms[k]:.1f}" for k in ("dispatch", "shared", "sync", "async", "saving_paired")),
                  f"{probe_ms['saving_of_bound']:.2f}")
    console.print(table)
    for line in load:
        console.print(f"uptime: {line}")
    return {"config": config | {"probe": PROBE}, "results": out, "probe_ms": probe_ms, "raw_s": raw,
            "probe_raw_s": probe, "uptime": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--maxvio", type=float, nargs="+", default=[0, 1, 2, 5, 10])
    parser.add_argument("--malloc", choices=list(MALLOC_ENV), default="cache", help="allocator settings for timing")
    parser.add_argument("--part", nargs="+", choices=["layer", "model"], default=["layer", "model"])
    parser.add_argument("--model-steps", type=int, default=20)
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 170)  # logs get the whole table
    path = OUT / "ep_runtime.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if "model" in args.part:
        results["model"] = model_part(args.model_steps, 3, console)
        OUT.mkdir(exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
    if "layer" in args.part:
        layer_part(args, console, results)


def layer_part(args: argparse.Namespace, console: Console, results: dict) -> None:
    """The MoE layer's sweep over maxvio: ours vs plain all_to_all EP (issue 4's claim)."""
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
    results.update(config=config, rows=rows)
    (OUT / "ep_runtime.json").write_text(json.dumps(results, indent=1))
    plot(rows, base, OUT / "ep_runtime.png")
    console.print(f"wrote {OUT / 'ep_runtime.json'} and {OUT / 'ep_runtime.png'}")


if __name__ == "__main__":
    main()
