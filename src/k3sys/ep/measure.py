"""Time a distributed MoE layer step on local gloo ranks: the engine of bench/ep_runtime.py and the demo.

`measure_step(StepSetup(...), methods)` spawns R processes (one thread each) on 127.0.0.1 and runs
fwd+bwd of the routed experts under synthetic routings, once per method per step:
- "ours": the balanced runtime (planner with exact caps, replicas);
- "baseline": the same layer with balancing off (planner tolerance R - 1: every pair on its expert's
  home rank, no replicas), which is plain all_to_all expert parallelism, the DeepEP-style baseline.
Methods take turns step by step in the same processes (alternating who goes first), so load from
elsewhere on a shared machine hits them alike. Per method: the median step time (each step timed by
its slowest rank); the median CPU time of the busiest rank (the compute balance, which other load
stretches less than wall time); the mean max/mean rank load and replica copies; the median minor page
faults per step of the busiest rank; and the peak RSS of the processes (max over ranks; fresh
processes per call, so with one method and `malloc="release"` it is that method's peak).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3sys.ep.layer import MoELayer
from k3sys.ep.parallelize import apply_ep
from k3sys.ep.routing import make_routing

__all__ = ["MALLOC_ENV", "METHODS", "StepSetup", "hot_on_rank0", "measure_step"]

METHODS = ("ours", "baseline")

# glibc malloc settings of the rank processes, by purpose.
# - "cache" (timing): freed memory stays in the process, as with a caching allocator (PyTorch's on
#   GPUs; jemalloc or tcmalloc on CPUs). Under glibc's defaults the heap top is trimmed and large
#   blocks are unmapped whenever they are freed, so each step faults tens of MB of pages back in
#   (thousands to tens of thousands of faults per step, 15-50 ms here), by glibc's heuristics rather
#   than by what the method computes.
# - "release" (memory): every block over 1 MiB goes back to the OS when freed, so the peak RSS
#   follows the live tensors instead of the allocator's history. It costs time (fresh pages).
# - "default": glibc's own heuristics, for comparison.
MALLOC_ENV = {
    "cache": {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
    "release": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "default": {},
}


@dataclass(frozen=True)
class StepSetup:
    """One measured configuration. placement: "spread" (hot experts where the routing puts them) or
    "rank0" (experts renamed so the hottest are rank 0's home experts)."""

    ranks: int = 2
    experts: int = 64
    top_k: int = 4
    hidden: int = 256
    ffn: int = 512
    tokens: int = 2048
    maxvio: float = 0.0
    placement: str = "spread"
    steps: int = 20
    warmup: int = 3


def hot_on_rank0(topk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rename experts in `topk` (any shape) by descending load, so the hottest live on rank 0."""
    rename = torch.empty(num_experts, dtype=torch.long)
    load = torch.bincount(topk.reshape(-1), minlength=num_experts)
    rename[load.argsort(descending=True, stable=True)] = torch.arange(num_experts)
    return rename[topk]


def _routings(c: StepSetup) -> list[torch.Tensor]:
    out = []
    for step in range(c.warmup + c.steps):
        ids = make_routing(c.ranks, c.tokens, c.experts, c.top_k, c.maxvio, seed=1, step=step)
        out.append(hot_on_rank0(ids, c.experts) if c.placement == "rank0" else ids)
    return out


def _worker(rank: int, c: StepSetup, methods: tuple[str, ...], port: int, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=c.ranks,
                            timeout=timedelta(minutes=10))
    _measure(rank, c, methods, out_file)
    # The layers (and their buffers, which hold the group) died with _measure's frame: the group is
    # destroyed here, not by the interpreter's exit, where gloo's threads died with SIGABRT ("terminate
    # called without an active exception", 2 of ~30 loaded suite runs). Every rank meets first.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _measure(rank: int, c: StepSetup, methods: tuple[str, ...], out_file: str) -> None:
    """The timed steps on this rank; rank 0 writes the medians to `out_file`."""
    layers = {}
    for m in methods:
        torch.manual_seed(0)  # same weights for every method
        layers[m] = apply_ep(MoELayer(c.hidden, c.ffn, c.experts, c.top_k), dist.group.WORLD, c.tokens,
                             tolerance=0.0 if m == "ours" else c.ranks - 1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(c.tokens, c.hidden, generator=g).requires_grad_()
    weights = torch.rand(c.tokens, c.top_k, generator=g).softmax(-1)
    grad_out = torch.randn(c.tokens, c.hidden, generator=g)
    keys = ("time", "cpu", "faults", "load", "copies")
    rec: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in methods}
    for i, ids in enumerate(_routings(c)):
        for m in methods if i % 2 == 0 else methods[::-1]:
            layer = layers[m]
            dist.barrier()
            t0, c0, f0 = time.perf_counter(), time.process_time(), _minor_faults()
            layer.routed_experts(x, ids[rank], weights).backward(grad_out)
            elapsed = torch.tensor([time.perf_counter() - t0, time.process_time() - c0, _minor_faults() - f0],
                                   dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            x.grad = None
            layer.zero_grad(set_to_none=True)  # as an optimizer step would
            if i >= c.warmup:
                stats = layer.stats()  # read after the timed step: the read is a host sync
                loads = torch.tensor(stats.slots_per_rank, dtype=torch.float64)
                for key, value in zip(keys, (*elapsed, loads.max() / loads.mean(), stats.copies), strict=True):
                    rec[m][key].append(float(value))
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out_file).write_text(json.dumps({m: {
            "time_s": statistics.median(r["time"]), "cpu_s": statistics.median(r["cpu"]),
            "page_faults": statistics.median(r["faults"]), "max_over_mean_load": statistics.mean(r["load"]),
            "copies": statistics.mean(r["copies"]), "peak_rss_mib": float(rss),
        } for m, r in rec.items()}))


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure_step(
    c: StepSetup, methods: Sequence[str] = METHODS, malloc: str = "cache"
) -> dict[str, dict[str, float]]:
    """Run `methods` on fresh local gloo ranks; per method: time_s, cpu_s, page_faults,
    max_over_mean_load, copies, peak_rss_mib.

    malloc: glibc's allocator settings for the ranks, a key of `MALLOC_ENV`: "cache" to time,
    "release" to measure peak memory, "default" for glibc's own.
    """
    if not methods or set(methods) - set(METHODS):
        raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {methods}")
    if malloc not in MALLOC_ENV:
        raise ValueError(f"malloc must be one of {tuple(MALLOC_ENV)}, got {malloc!r}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    names = {name for env in MALLOC_ENV.values() for name in env}
    saved = {name: os.environ.pop(name, None) for name in names}
    os.environ.update(MALLOC_ENV[malloc])  # the spawned ranks inherit it
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            mp.spawn(_worker, args=(c, tuple(methods), port, f.name), nprocs=c.ranks)
            return json.loads(Path(f.name).read_text())
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
