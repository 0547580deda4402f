"""Claim: `kda_chunk`'s forward costs the same per token from T = 1K to 64K (and 256K): flat within 15%,
and so is its peak memory per token (B=1, H=4, K=V=128, fp32, CPU, 1 thread). The peak includes
one-time library buffers (~10-20 MB), which dominate at 1K: read the memory column from 4K on.

Why it was not: phase 1 used to run over the whole sequence at once, so its ~15 temporaries grew with T;
above 32 MB (T >= 16K here) glibc serves each from fresh mmap pages that the kernel faults in and zeroes
on every call. The diagnosis is measured, not assumed: the same whole-sequence form is timed per phase
(gather into slots / phase 1 / phase 2 / scatter) with glibc's default allocator and with mmap turned
off (MALLOC_MMAP_MAX_=0: freed memory is reused, no page faults); if only the allocator setting closes
the gap, the cost was allocation, not memory traffic. Then `kda_chunk` as it is now (phase 1 in blocks
of `PHASE1_ROWS` rows, each followed by its phase-2 steps) with the default allocator.

Times are CPU times of the one-thread process (user + system, so page faults count), wall times beside
them: on this shared machine the wall time also counts waiting for a core. Every (variant, T) runs in a
fresh process (so the peak RSS is its own): peak memory = the process's
max RSS minus its RSS before the call. Writes bench/results/kda_scaling.json. (The issue asked for this
in bench/kda.py; it is its own script because bench/kda.py was being rewritten at the same time.)

    PYTHONPATH=src python bench/kda_scaling.py [--quick] [--max-t 262144]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from k3sys.kda import kda_chunk, kda_gate
from k3sys.kda.chunk import chunk_layout, from_slots, inter_chunk, intra_chunk, to_slots

RESULTS = Path(__file__).parent / "results"
H, K, V, C = 4, 128, 128, 16
FLAT = 1.15  # the claim: max / min cost per token
REPEATS = {1024: 31, 4096: 11, 16384: 5, 65536: 3, 262144: 1}


def _inputs(T: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen)
    g = kda_gate(torch.randn(1, T, H, K, generator=gen), torch.zeros(H), torch.zeros(H, K), lower_bound=-5.0)
    return q, k, v, g, torch.rand(1, T, H, generator=gen)


def _whole_sequence(q, k, v, g, beta, phases: dict[str, float]) -> torch.Tensor:
    """The previous form of `kda_chunk` (phase 1 over all chunks at once), timing each phase into `phases`."""
    T = q.shape[1]
    t0 = time.process_time()
    layout = chunk_layout(torch.tensor([T]), torch.tensor([0]), C, H)
    xs = [to_slots(x, layout, torch.float32) for x in (q, k, v, g)] + [to_slots(beta[..., None], layout,
                                                                                 torch.float32)[..., 0]]
    t1 = time.process_time()
    ws = intra_chunk(*xs, scale=K**-0.5)
    t2 = time.process_time()
    O, *_ = inter_chunk(ws, layout.active, torch.zeros(1, H, K, V))
    t3 = time.process_time()
    o = from_slots(O, layout, 1, T)
    t4 = time.process_time()
    for name, dt in (("gather", t1 - t0), ("phase 1", t2 - t1), ("phase 2", t3 - t2), ("scatter", t4 - t3)):
        phases[name] = phases.get(name, 0.0) + dt
    return o


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _measure(variant: str, T: int, repeats: int) -> dict:
    """In a fresh process: median CPU and wall time of one forward (after a warm-up), phases, peak extra RSS.

    CPU time (user + system of this one-thread process, page faults included) is the measure: on a machine
    shared with other jobs the wall time also counts the time spent waiting for a core.
    """
    torch.set_num_threads(1)
    xs = _inputs(T)
    before = _rss_kb()
    phases: dict[str, float] = {}
    cpu, wall = [], []
    with torch.no_grad():
        for i in range(repeats + 1):
            c0, w0 = time.process_time(), time.perf_counter()
            if variant == "kda_chunk":
                kda_chunk(*xs, chunk_size=C, backend="torch")
            else:
                _whole_sequence(*xs, phases if i else {})
            if i:
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    ms = 1e3 * sorted(cpu)[len(cpu) // 2]
    return dict(variant=variant, T=T, ms=ms, wall_ms=1e3 * sorted(wall)[len(wall) // 2], us_per_token=1e3 * ms / T,
                peak_mb=peak / 1024,
                peak_bytes_per_token=1024 * peak / T,
                phases_us_per_token={n: 1e6 * t / repeats / T for n, t in phases.items()})


def _run(variant: str, T: int, repeats: int, env: dict[str, str]) -> dict:
    saved = {n: os.environ.get(n) for n in env}
    os.environ.update(env)  # read by glibc when the child starts
    try:
        with mp.get_context("spawn").Pool(1) as pool:
            return pool.apply(_measure, (variant, T, repeats))
    finally:
        for n, val in saved.items():
            if val is None:
                os.environ.pop(n)
            else:
                os.environ[n] = val


VARIANTS = {
    # phase 1 over the whole sequence (the form before), default glibc allocator
    "before": ("whole", {}),
    # the same, glibc never returning memory to the OS: no fresh pages per call
    "before, mmap off": ("whole", {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}),
    # kda_chunk now: phase 1 in blocks, default allocator
    "now": ("kda_chunk", {}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T up to 4K, 1 repeat")
    ap.add_argument("--max-t", type=int, default=262144, help="largest T (256K needs ~6 GB)")
    args = ap.parse_args()
    ts = [1024, 4096] if args.quick else [t for t in (1024, 4096, 16384, 65536, 262144) if t <= args.max_t]
    rows = []
    for label, (variant, env) in VARIANTS.items():
        for T in ts:
            if T > 65536 and variant == "whole":
                continue  # the before/after diagnosis needs no 256K run of the slow form
            # short calls vary by +-20% on this shared machine: more repeats where a call is short
            repeats = 1 if args.quick else REPEATS[T]
            rows.append(dict(_run(variant, T, repeats, env), label=label))
            print(f"{label:16s} T={T:7d} {rows[-1]['us_per_token']:8.1f} us/token", flush=True)
    table = Table(title=f"kda_chunk forward per token (B=1, H={H}, K=V={K}, C={C}, fp32, 1 thread)")
    for col in ("variant", "T", "CPU ms", "wall ms", "CPU us/token", "x 1K", "peak B/token", "gather",
                "phase 1", "phase 2"):
        table.add_column(col, justify="right")
    for label in VARIANTS:
        mine = [r for r in rows if r["label"] == label]
        base = mine[0]["us_per_token"]
        for r in mine:
            r["ratio_to_1k"] = r["us_per_token"] / base
            ph = r["phases_us_per_token"]
            table.add_row(label, str(r["T"]), f"{r['ms']:.0f}", f"{r['wall_ms']:.0f}", f"{r['us_per_token']:.1f}",
                          f"{r['ratio_to_1k']:.2f}",
                          f"{r['peak_bytes_per_token']:.0f}", *(f"{ph[n]:.1f}" if n in ph else "-"
                                                                for n in ("gather", "phase 1", "phase 2")))
        spread = max(r["us_per_token"] for r in mine) / min(r["us_per_token"] for r in mine)
        print(f"{label}: max/min CPU time per token {spread:.2f} ({'flat' if spread <= FLAT else 'NOT flat'} "
              f"within {FLAT - 1:.0%})")
    Console(width=140).print(table)
    RESULTS.mkdir(exist_ok=True)
    load = os.getloadavg()
    (RESULTS / "kda_scaling.json").write_text(json.dumps(dict(
        config=dict(B=1, H=H, K=K, V=V, C=C, dtype="fp32", threads=1), loadavg=load, rows=rows), indent=1))


if __name__ == "__main__":
    main()
