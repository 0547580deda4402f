"""Claim: a KDA decode step runs at >= 60% of its memory-bound floor for N = 1 and N = 64 sequences.

A step reads the state `[N, H, K, V]` (fp32) once and writes it once; everything else it touches is
K + V numbers per head. Its floor is therefore the time of a `copy_` of the state's bytes on this
machine, measured here in the same run, one thread. Two regimes:

- hot: the same state every call (at N = 1 it stays in L2, at N = 64, 16 MiB, mostly in L3); the floor
  is a copy between two state-sized buffers, the same ones every call;
- cold, as in a model, where the other layers evict a layer's state between its steps: the calls rotate
  over enough states to pass the last-level cache (>= 96 MiB), and so does the floor's copy.

Rows: `kda_step` (the default contract: a new state each call), `kda_step(..., inplace=True)`, the
layer's decode path `step_unchecked(..., inplace=True)` (no input checks; what `KimiDeltaAttention`
runs with a cache), and "before": `kda_step` with the fused kernel switched off (the torch formula it
ran before, and still runs without a compiler or under autograd). B=1 layer shapes of bench/kda.py:
H=4, K=V=128. Timed in CPU time of the calling thread (`time.thread_time`: on this shared 2-core machine
waiting for a core would otherwise dominate), medians over rounds that call every method once in turn.
Writes bench/results/kda_decode.json.

    PYTHONPATH=src python bench/kda_decode.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from k3sys.kda import fused_step, kda_step
from k3sys.kda.step import step_unchecked

RESULTS = Path(__file__).parent / "results"
H, K, V = 4, 128, 128
SEQUENCES = (1, 64)
COLD_BYTES = 96 << 20  # well past this machine's 32 MiB L3
TARGET = 0.6


@contextlib.contextmanager
def torch_formula() -> Iterator[None]:
    """kda_step as it ran before the fused kernel (and runs where the kernel cannot be built)."""
    available = fused_step.available
    fused_step.available = lambda: False
    try:
        yield
    finally:
        fused_step.available = available


def step_inputs(N: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One decoded token per sequence: q, k (normalised) `[N, H, K]`, v `[N, H, V]`, g `[N, H, K]` in
    (-0.1, 0], beta `[N, H]`."""
    q, k = (F.normalize(torch.randn(N, H, K, generator=gen), dim=-1) for _ in range(2))
    return q, k, torch.randn(N, H, V, generator=gen), -0.1 * torch.rand(N, H, K, generator=gen), \
        torch.rand(N, H, generator=gen)


def methods(xs: tuple[torch.Tensor, ...], states: list[torch.Tensor], dsts: list[torch.Tensor]
            ) -> dict[str, Callable[[int], object]]:
    """Each method as a call on state i (of the rotation)."""
    def before(i: int) -> object:
        with torch_formula():
            return kda_step(*xs, states[i])

    return {
        "copy_ (floor)": lambda i: dsts[i].copy_(states[i]),
        "kda_step": lambda i: kda_step(*xs, states[i]),
        "kda_step inplace": lambda i: kda_step(*xs, states[i], inplace=True),
        "step_unchecked inplace (layer)": lambda i: step_unchecked(*xs, states[i], inplace=True),
        "before: kda_step, torch formula": before,
    }


def time_round_robin(calls: dict[str, Callable[[int], object]], rotation: int, per_sample: int, repeats: int
                     ) -> dict[str, float]:
    """Median CPU us per call of each method: a sample is `per_sample` calls walking the rotation of states;
    every round takes one sample of each method in turn, so all see the same load."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for rnd in range(repeats + 1):  # round 0 warms up (page faults, the kernel's first build)
        for name, fn in calls.items():
            t0 = time.thread_time()
            for c in range(per_sample):
                fn(c % rotation)
            if rnd:
                samples[name].append((time.thread_time() - t0) / per_sample)
    return {name: 1e6 * statistics.median(ts) for name, ts in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=160)
    load_start = os.getloadavg()
    built = fused_step.available()
    console.print(f"fused kernel: {'built' if built else 'NOT available: every row is the torch formula'}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for N in SEQUENCES:
        xs = step_inputs(N, gen)
        state_bytes = N * H * K * V * 4
        for regime in ("hot", "cold"):
            rotation = 1 if regime == "hot" else math.ceil(COLD_BYTES / state_bytes)
            states = [0.1 * torch.randn(N, H, K, V, generator=gen) for _ in range(rotation)]
            dsts = [torch.empty_like(s) for s in states]
            # at least 8 calls and one pass over the rotation per sample, ~20 MiB of state at N = 1
            per_sample = max(rotation, 8, (20 << 20) // state_bytes)
            us = time_round_robin(methods(xs, states, dsts), rotation, per_sample, args.repeats)
            floor = us.pop("copy_ (floor)")
            for name, t in us.items():
                rows.append({"N": N, "regime": regime, "method": name, "us": t, "floor_us": floor,
                             "fraction_of_floor": floor / t, "copy_GBps": 2 * state_bytes / floor / 1e3,
                             "state_bytes": state_bytes})
            console.log(f"N={N} {regime}: floor {floor:.1f} us, " + ", ".join(f"{n} {t:.1f}" for n, t in us.items()))

    table = Table(title=f"KDA decode step, H={H} K=V={K} fp32, {args.threads} thread(s): median us per step "
                        f"against the floor (a copy_ of the state, same run); load {load_start[0]:.1f} at start")
    for col in ("N", "state", "regime", "copy GB/s", "floor us", "method", "us", "floor / this"):
        table.add_column(col, justify="right")
    for r in rows:
        mark = "" if r["method"].startswith("before") else (" ok" if r["fraction_of_floor"] >= TARGET else " < 0.6")
        table.add_row(str(r["N"]), f"{r['state_bytes'] >> 10} KiB", r["regime"], f"{r['copy_GBps']:.1f}",
                      f"{r['floor_us']:.1f}", r["method"], f"{r['us']:.1f}", f"{r['fraction_of_floor']:.2f}{mark}")
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    out = {"config": {"H": H, "K": K, "V": V, "dtype": "float32", "sequences": SEQUENCES, "cold_bytes": COLD_BYTES,
                      "repeats": args.repeats, "target_fraction": TARGET, "fused_kernel": built},
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "threads": torch.get_num_threads(), "load_avg_at_start": load_start,
                       "load_avg_at_end": os.getloadavg(), "shared": "other jobs ran on the same cores"},
           "rows": rows}
    (RESULTS / "kda_decode.json").write_text(json.dumps(out, indent=2) + "\n")
    console.log(f"wrote {RESULTS / 'kda_decode.json'}")


if __name__ == "__main__":
    main()
