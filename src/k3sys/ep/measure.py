"""Time a distributed MoE layer step on local gloo ranks: the engine of bench/ep_runtime.py and the demo.

`measure_step(StepSetup(...))` spawns R processes (one thread each) on 127.0.0.1, runs fwd+bwd of the
routed experts under synthetic routings, and returns per setup: the median step time (each step timed
by its slowest rank); the median CPU time of the busiest rank per step (the compute balance, which
other load on a shared machine does not inflate the way it stretches wall time); the peak RSS (max
over ranks, fresh processes per call, so it is this setup's peak); the mean max/mean rank load and the
mean replica copies. `balance=False` runs the same layer with balancing off (planner tolerance R - 1:
every pair on its expert's home rank, no replicas): plain all_to_all expert parallelism, the
DeepEP-style baseline.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3sys.ep.layer import MoELayer
from k3sys.ep.routing import make_routing

__all__ = ["StepSetup", "hot_on_rank0", "measure_step"]


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
    balance: bool = True
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


def _worker(rank: int, c: StepSetup, port: int, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=c.ranks,
                            timeout=timedelta(minutes=10))
    torch.manual_seed(0)
    layer = MoELayer(c.hidden, c.ffn, c.experts, c.top_k, group=dist.group.WORLD, capacity=c.tokens,
                     tolerance=0.0 if c.balance else c.ranks - 1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(c.tokens, c.hidden, generator=g).requires_grad_()
    weights = torch.rand(c.tokens, c.top_k, generator=g).softmax(-1)
    grad_out = torch.randn(c.tokens, c.hidden, generator=g)
    times, cpu_times, imbalance, copies = [], [], [], []
    for i, ids in enumerate(_routings(c)):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        layer.routed_experts(x, ids[rank], weights).backward(grad_out)
        elapsed = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        x.grad = None
        layer.zero_grad(set_to_none=True)  # as an optimizer step would
        if i >= c.warmup:
            loads = torch.tensor(layer.last_stats.slots_per_rank, dtype=torch.float64)
            times.append(float(elapsed[0]))
            cpu_times.append(float(elapsed[1]))
            imbalance.append(float(loads.max() / loads.mean()))
            copies.append(layer.last_stats.copies)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out_file).write_text(json.dumps({
            "time_s": statistics.median(times), "cpu_s": statistics.median(cpu_times),
            "max_over_mean_load": statistics.mean(imbalance), "copies": statistics.mean(copies),
            "peak_rss_mib": float(rss),
        }))
    dist.destroy_process_group()


def measure_step(c: StepSetup) -> dict[str, float]:
    """Run `c` on fresh local gloo ranks; returns time_s, cpu_s, max_over_mean_load, copies, peak_rss_mib."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A fixed mmap threshold makes glibc hand every large tensor back to the OS when freed, so the
    # peak RSS follows the live tensors instead of the allocator's history.
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            mp.spawn(_worker, args=(c, port, f.name), nprocs=c.ranks)
            return json.loads(Path(f.name).read_text())
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
