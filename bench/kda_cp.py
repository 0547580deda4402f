"""Claim: exact context parallelism (`kda_chunk_cp`) splits one T = 64K sequence over R ranks with the
time per rank near the flop model's (1 + c) / R of the single-process op, where c is the correction's
extra work (docs/kda.md, "Context parallel"), and only R - 1 carry elements `[H, K, K + V]` received
per rank in the forward, whatever T.

R = 1, 2, 4 gloo ranks on 127.0.0.1, 1 thread each, B=1, H=2, K=V=128, fp32, forward (no grad). R = 1 is
plain `kda_chunk`. Each rank times its own call (barrier before each); the step's time is the slowest
rank's. Beside the wall times (which, on a machine whose cores are shared with other jobs, also count
waiting for a core), each rank's CPU time: the largest over 1 rank's is the work fraction, the
load-independent counterpart of (1 + c) / R. Writes bench/results/kda_cp.json.

    PYTHONPATH=src python bench/kda_cp.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from _timing import median_ms
from k3sys.kda import kda_chunk, kda_gate
from k3sys.kda.cp import _transition_call, kda_chunk_cp

RESULTS = Path(__file__).parent / "results"
H, K, V, C = 2, 128, 128, 16


def correction(K: int, V: int, C: int) -> float:
    """Extra flops per token of a rank that receives a state, over the plain op's (docs/kda.md).

    Plain op per token and head: phase 1 8CK + 4CV (decayed products, W, Qs; U, Ou), phase 2 6KV.
    A receiving rank runs it with the value widened to V + K, then adds qt S0 (2KV).
    """
    plain = 8 * C * K + 4 * C * V + 6 * K * V
    return (4 * C * K + 6 * K * K + 2 * K * V) / plain


def _inputs(T: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen)
    g = kda_gate(torch.randn(1, T, H, K, generator=gen), torch.zeros(H), torch.zeros(H, K), lower_bound=-5.0)
    beta = torch.rand(1, T, H, generator=gen)
    return tuple(x[:, start:end].contiguous() for x in (q, k, v, g, beta))


def _rank(rank: int, world: int, port: int, T: int, repeats: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = T // world
    xs = _inputs(T, rank * n, (rank + 1) * n)
    times, cpu = [], []
    with torch.no_grad():
        for i in range(repeats + 1):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if world == 1:
                kda_chunk(*xs, chunk_size=C, backend="torch", output_final_state=True)
            else:
                kda_chunk_cp(*xs, group=dist.group.WORLD, chunk_size=C, backend="torch", output_final_state=True)
            if i:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
    out.put((rank, (times, cpu)))
    dist.destroy_process_group()


def measured_correction(T: int, repeats: int) -> float:
    """c measured in one process (immune to ranks sharing cores): a receiving rank's work on T tokens
    (the widened call and the qt S0 product) over the plain op's, in CPU time, 1 thread."""
    xs = _inputs(T, 0, T)
    S0 = torch.randn(1, H, K, V)

    def receiving() -> None:
        o_loc, qt, _, _ = _transition_call(*xs, None, C, "torch", {})
        o_loc + torch.einsum("bthk,bhkv->bthv", qt, S0)

    with torch.no_grad():  # CPU time: immune to waiting for a core
        plain = median_ms(lambda: kda_chunk(*xs, chunk_size=C, backend="torch"), repeats, 1, time.process_time)
        return median_ms(receiving, repeats, 1, time.process_time) / plain - 1


def run(world: int, T: int, repeats: int) -> list[tuple[list[float], list[float]]]:
    """Per rank, the wall and CPU seconds of each timed call."""
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, T, repeats, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T = 4K, 1 repeat")
    args = ap.parse_args()
    T, repeats = (4096, 1) if args.quick else (65536, 3)
    c = correction(K, V, C)
    element = H * K * (K + V) * 4  # one rank's carry [S | M] in fp32
    rows = []
    for R in (1, 2, 4):
        per_rank = run(R, T, repeats)
        # a step ends when its slowest rank does
        steps = sorted(max(ts) for ts in zip(*(wall for wall, _ in per_rank), strict=True))
        rows.append(dict(ranks=R, ms=1e3 * steps[len(steps) // 2],
                         rank_ms=[1e3 * sorted(wall)[len(wall) // 2] for wall, _ in per_rank],
                         rank_cpu_ms=[1e3 * sorted(cpu)[len(cpu) // 2] for _, cpu in per_rank],
                         bytes_received_per_rank=(R - 1) * element, theory=1.0 if R == 1 else (1 + c) / R))
        print(f"R={R}: {rows[-1]['ms']:.0f} ms (per rank {[round(x) for x in rows[-1]['rank_ms']]})", flush=True)
    base = rows[0]["ms"]
    table = Table(title=f"kda_chunk_cp forward, T={T}, B=1, H={H}, K=V={K}, C={C}, fp32, 1 thread per rank")
    for col in ("ranks", "wall ms", "per-rank wall ms", "speedup", "wall / 1 rank", "per-rank CPU ms",
                "max CPU / 1 rank", "theory (1+c)/R", "bytes in / rank"):
        table.add_column(col, justify="right")
    base_cpu = rows[0]["rank_cpu_ms"][0]
    for r in rows:
        r["speedup"], r["fraction"] = base / r["ms"], r["ms"] / base
        r["cpu_fraction"] = max(r["rank_cpu_ms"]) / base_cpu
        table.add_row(str(r["ranks"]), f"{r['ms']:.0f}", " ".join(f"{x:.0f}" for x in r["rank_ms"]),
                      f"{r['speedup']:.2f}", f"{r['fraction']:.2f}", " ".join(f"{x:.0f}" for x in r["rank_cpu_ms"]),
                      f"{r['cpu_fraction']:.2f}", f"{r['theory']:.2f}", f"{r['bytes_received_per_rank']:,}")
    Console(width=140).print(table)
    c_measured = measured_correction(T // 4, repeats)
    print(f"correction c = {c:.3f} (flop model, K=V={K}, C={C}), {c_measured:.3f} measured on T/4 tokens in one "
          f"process; load average {os.getloadavg()}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kda_cp.json").write_text(json.dumps(dict(
        config=dict(T=T, B=1, H=H, K=K, V=V, C=C, dtype="fp32", threads_per_rank=1), correction=c,
        correction_measured=c_measured,
        loadavg=os.getloadavg(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
