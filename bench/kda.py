"""Claim: the two-phase chunked KDA forward at T=4096 (B=1, H=4, K=V=128, fp32, CPU) takes <= 100 ms
where the token-by-token recurrence takes over 1 s; it runs >= 3x FlashKDA's C++ CPU extension at every
T; the two-phase form (all intra-chunk work in one batched pass, then the chunk loop) beats a single loop
that does each chunk's intra-chunk work inside the loop (the CPU version of FlashKDA's two-kernel claim);
computing the activations inside the op (fla's `*_in_kernel` options) costs <= 5%; the chunked forward
runs at >= 45% of this CPU's fp32 matmul peak (a 1024^2 matmul timed in the same rounds, so under the
same load; its best round), in GFLOP/s of the flop model `chunk_flops`; and the decode state stays the
same size while a full-attention KV cache of the same heads grows with the context.

Sweep: T in {1024, 4096, 16384}; forward and forward+backward; ours (token loop, chunk C=16/32/64,
chunk C=16 from raw inputs with in-op activations, single-loop C=16) and the baselines, when present:
FlashKDA's CPU backend (commit b5cecff: its C++ extension and its torch token loop) from a built checkout
at $K3SYS_FLASHKDA_PATH, and fla's naive references (`pip install k3sys[bench]`: fla-core). Slow token
loops stop at T = 4096 (their backward graph would hold ~12 GB at 16384). Writes bench/results/kda.json.

    K3SYS_FLASHKDA_PATH=.cache/flashkda PYTHONPATH=src python bench/kda.py [--quick]
    PYTHONPATH=src python bench/kda.py --lengths 4096 16384 65536 --methods chunk16 chunk16_act \
        --threads 1 --cpu-time --forward-only --output kda_rate_after.json   # the fraction of peak (docs/kda.md)

A partial run (`--methods` without chunk16, chunk16_act, naive and single16, or no T = 4096) records its
rows without the claims.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from _timing import median_ms
from k3sys.kda import kda_chunk, kda_gate, kda_naive, kda_state_bytes, kv_cache_bytes
from k3sys.kda.activations import l2_normalize
from k3sys.kda.chunk import chunk_layout, from_slots, inter_chunk_step, intra_chunk, to_slots

RESULTS = Path(__file__).parent / "results"
B, H, K, V = 1, 4, 128, 128
TARGET_MS = 100.0
PEAK_FRACTION_TARGET = 0.45
PEAK_N = 1024  # the matmul whose rate is "this CPU's peak" (the 75 GFLOP/s on one thread)
CONTEXTS = {"4K": 4096, "128K": 131072, "1M": 1048576}
# The token loops' autograd graphs keep about 0.75 MB of state copies per token at this size (12 GB at
# T = 16384), so their backward is only measured up to here; the slowest loops stop there altogether.
NAIVE_BACKWARD_MAX_T = 4096
# Methods run only up to NAIVE_BACKWARD_MAX_T (seconds per call beyond), and methods timed forward only.
SHORT = {"flashkda_torch", "fla_naive_recurrent", "fla_naive_chunk"}
FORWARD_ONLY = {"fla_naive_recurrent", "fla_naive_chunk"}  # references; fla's chunk form NaNs its gradients
# The in-op activations benchmarked: fla's full set with the safe gate, as Kimi Linear runs it.
ACTIVATIONS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                   use_beta_sigmoid_in_kernel=True)


def kda_chunk_single_loop(q, k, v, g, beta, chunk_size: int = 16) -> torch.Tensor:
    """The fused baseline: one loop over chunks doing each chunk's phase-1 work, then its phase-2 step.

    Same pieces as `kda_chunk` (layout, `intra_chunk`, `inter_chunk_step`), so the only difference
    measured is where the intra-chunk work runs. B sequences of equal length, zero initial state.
    """
    Bq, T, Hq, Kq = q.shape
    layout = chunk_layout(torch.full((Bq,), T), torch.arange(Bq) * T, chunk_size, Hq)
    xs = [to_slots(x, layout, torch.float32) for x in (q, k, v, g)] + [to_slots(beta[..., None], layout,
                                                                                  torch.float32)[..., 0]]
    S = torch.zeros(Bq * Hq, Kq, v.shape[-1])
    outs = []
    for step in zip(*(x.split(layout.active) for x in xs), strict=True):
        O, S = inter_chunk_step(S, intra_chunk(*step, scale=Kq**-0.5).heads_flat())
        outs.append(O)
    return from_slots(torch.cat(outs).view(layout.num_slots, Hq, chunk_size, -1), layout, Bq, T)


def chunk_flops(T: int, C: int) -> float:
    """Flops of the chunked forward (docs/kda.md, "Context parallel"): per token and head, phase 1's
    8CK + 4CV (decayed products, W and Qs; U and Ou) and phase 2's 6KV (W S, Qs S, Kd^T V')."""
    return float(B * T * H * (8 * C * K + 4 * C * V + 6 * K * V))


Inputs = dict[str, object]  # "xs": activated [q, k, v, g, beta]; "raw": the same before activation; "opts"


CHUNK_SIZES = {"chunk16": 16, "chunk16_act": 16, "chunk32": 32, "chunk64": 64, "single16": 16}  # rated in GFLOP/s


def our_methods() -> dict[str, Callable[[Inputs], torch.Tensor]]:
    return {
        "naive": lambda x: kda_naive(*x["xs"])[0],
        "chunk16": lambda x: kda_chunk(*x["xs"], chunk_size=16)[0],
        "chunk16_act": lambda x: kda_chunk(*x["raw"], chunk_size=16, **x["opts"])[0],
        "chunk32": lambda x: kda_chunk(*x["xs"], chunk_size=32)[0],
        "chunk64": lambda x: kda_chunk(*x["xs"], chunk_size=64)[0],
        "single16": lambda x: kda_chunk_single_loop(*x["xs"], chunk_size=16),
    }


def baseline_methods(console: Console) -> tuple[dict[str, Callable[[Inputs], torch.Tensor]], dict[str, str]]:
    """FlashKDA's and fla's CPU ops where installed, and a note for each one that is not."""
    methods, notes = {}, {}
    path = os.environ.get("K3SYS_FLASHKDA_PATH")
    if not path:
        notes["flashkda"] = "K3SYS_FLASHKDA_PATH is not set: FlashKDA rows skipped (see docs/kda.md to build it)"
    else:
        sys.path.insert(0, str(Path(path).resolve()))
        try:
            flash_kda = importlib.import_module("flash_kda")
            commit = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
            notes["flashkda"] = f"FlashKDA {commit or '(no git)'} from {path}"
            if flash_kda.has_cpu_extension():
                methods["flashkda_cpp"] = lambda x: flash_kda.torch_kda(*x["xs"], use_cpp_backend=True)[0]
            else:
                notes["flashkda"] += "; its C++ extension is not built, so only its torch loop runs"
            methods["flashkda_torch"] = lambda x: flash_kda.torch_kda(*x["xs"], use_cpp_backend=False)[0]
        except ImportError as e:
            notes["flashkda"] = f"FlashKDA at {path} does not import ({e}): its rows skipped"
    try:
        from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

        methods["fla_naive_recurrent"] = lambda x: naive_recurrent_kda(*x["xs"])[0]
        methods["fla_naive_chunk"] = lambda x: naive_chunk_kda(*x["xs"])[0]
    except ImportError as e:
        notes["fla"] = f"fla-core is not installed ({e}): fla rows skipped (pip install 'k3sys[bench]')"
    for note in notes.values():
        console.print(f"[yellow]note:[/] {note}")
    return methods, notes


def make_inputs(T: int, seed: int = 0) -> Inputs:
    """Raw inputs (unnormalised q, k; gate input f; beta logits; A_log, dt_bias) and the same activated."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v, f = torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, K, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    beta_logits = torch.randn(B, T, H, generator=gen)
    g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    xs = [l2_normalize(q, 1e-6), l2_normalize(k, 1e-6), v, g, torch.sigmoid(beta_logits)]
    return {"xs": xs, "raw": [q, k, v, f, beta_logits], "opts": {**ACTIVATIONS, "A_log": A_log, "dt_bias": dt_bias}}


def call(fn: Callable[[Inputs], torch.Tensor], x: Inputs, backward: bool) -> Callable[[], object]:
    """One forward (no autograd) or forward+backward of fn on x, as a thunk to time."""
    if not backward:
        return lambda: torch.no_grad()(fn)(x)
    leaves = {"xs": [t.clone().requires_grad_() for t in x["xs"]],
              "raw": [t.clone().requires_grad_() for t in x["raw"]], "opts": x["opts"]}
    w = torch.randn_like(x["xs"][2])
    return lambda: (fn(leaves) * w).sum().backward()


def round_robin_ms(thunks: dict[str, Callable[[], object]], repeats: int,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """The ms of each thunk in each of `repeats` rounds that call every thunk once in turn (after one warm-up
    call each): on a shared machine whose load drifts, every method is timed under the same conditions,
    so their ratios hold even when the absolute times do not. `clock`: wall time, or `time.process_time`
    (CPU time of every thread of the process: waiting for a core does not count)."""
    for thunk in thunks.values():
        thunk()
    times: dict[str, list[float]] = {name: [] for name in thunks}
    for _ in range(repeats):
        for name, thunk in thunks.items():
            t0 = clock()
            thunk()
            times[name].append(clock() - t0)
    return {name: [1e3 * t for t in ts] for name, ts in times.items()}


def _claims(by: dict, lengths: list[int], peaks: dict[int, float], methods: dict) -> dict[str, object]:
    """The module docstring's claims, from a full run's rows `by[(T, method)]`."""
    at4k = by[(4096, "chunk16")]["fwd_ms"]
    claims = {
        "chunk16_fwd_T4096_ms": at4k,
        "chunk16_fwd_T4096_within_target": at4k <= TARGET_MS,
        "naive_fwd_T4096_ms": by[(4096, "naive")]["fwd_ms"],
        "two_phase_beats_single_loop": all(by[(T, "chunk16")][p] < by[(T, "single16")][p]
                                           for T in lengths for p in ("fwd_ms", "fwd_bwd_ms")
                                           if by[(T, "chunk16")][p] is not None),
        "matmul_peak_gflops": peaks,
        "chunk16_fwd_fraction_of_peak": {T: by[(T, "chunk16")]["fwd_fraction_of_peak"] for T in lengths},
        "chunk16_fwd_at_least_45pct_of_peak_from_4K": all(
            by[(T, "chunk16")]["fwd_fraction_of_peak"] >= PEAK_FRACTION_TARGET for T in lengths if T >= 4096),
        "in_op_activations_overhead": {T: {p: by[(T, "chunk16_act")][p] / by[(T, "chunk16")][p] - 1
                                           for p in ("fwd_ms", "fwd_bwd_ms") if by[(T, "chunk16")][p] is not None}
                                       for T in lengths},
    }
    if "flashkda_cpp" in methods:
        claims["chunk16_over_flashkda_cpp"] = {
            T: {p: by[(T, "flashkda_cpp")][p] / by[(T, "chunk16")][p] for p in ("fwd_ms", "fwd_bwd_ms")}
            for T in lengths}
        claims["at_least_3x_flashkda_cpp_fwd"] = all(
            v["fwd_ms"] >= 3 for v in claims["chunk16_over_flashkda_cpp"].values())
    return claims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T in {1024, 4096} only")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="the T to sweep (a smoke run)")
    parser.add_argument("--output", default="kda.json", help="results file under bench/results/")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time CPU time of the process instead of wall time (a loaded machine)")
    parser.add_argument("--forward-only", action="store_true", help="skip forward+backward (long T)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="the methods to run (default all; the claims need chunk16, chunk16_act, naive, single16)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = args.lengths or ((1024, 4096) if args.quick else (1024, 4096, 16384))
    console = Console(width=160)
    baselines, notes = baseline_methods(console)
    methods = {**our_methods(), **baselines}
    if args.methods:
        unknown = sorted(set(args.methods) - set(methods))
        if unknown:
            parser.error(f"unknown methods {unknown}; known: {sorted(methods)}")
        methods = {name: fn for name, fn in methods.items() if name in args.methods}
    load_start = os.getloadavg()
    clock = time.process_time if args.cpu_time else time.perf_counter

    rows, peaks = [], {}
    for T in lengths:
        x = make_inputs(T)
        ref = kda_naive(*(t.double() for t in x["xs"]))[0]
        run = {name: fn for name, fn in methods.items() if not (name in SHORT and T > NAIVE_BACKWARD_MAX_T)}
        slow = {name for name in run if name == "naive" or name in SHORT}
        timings: dict[str, dict[str, float | None]] = {name: {"fwd_ms": None, "fwd_bwd_ms": None} for name in run}
        for key, backward in (("fwd_ms", False), ("fwd_bwd_ms", True))[:1 if args.forward_only else 2]:
            fast = {n: call(fn, x, backward) for n, fn in run.items() if n not in slow}
            if not backward:  # the peak, timed in the same rounds as the methods it is compared with
                a = torch.randn(PEAK_N, PEAK_N)
                fast["matmul"] = lambda a=a: a @ a
            for name, ms in round_robin_ms(fast, args.repeats, clock).items():
                if name == "matmul":  # its best round: a peak, so the fractions err on the low side
                    peaks[T] = 2 * PEAK_N**3 / min(ms) / 1e6
                else:
                    timings[name][key] = statistics.median(ms)
            # the token loops cost seconds per call at long T: timed apart, with fewer repeats
            for name in sorted(slow):
                if backward and (name in FORWARD_ONLY or T > NAIVE_BACKWARD_MAX_T):
                    continue
                reps = 1 if backward or T >= 4096 else max(1, args.repeats // 3)
                timings[name][key] = median_ms(call(run[name], x, backward), reps, clock=clock)
        for name, fn in run.items():
            with torch.no_grad():
                err = ((fn(x).double() - ref).norm() / ref.norm()).item()
            C = CHUNK_SIZES.get(name)
            gflops = None if C is None else chunk_flops(T, C) / timings[name]["fwd_ms"] / 1e6
            rows.append({"T": T, "method": name, **timings[name], "rel_err_vs_fp64": err, "fwd_gflops": gflops,
                         "fwd_fraction_of_peak": None if gflops is None else gflops / peaks[T]})
            bwd = timings[name]["fwd_bwd_ms"]
            console.log(f"T={T} {name}: fwd {timings[name]['fwd_ms']:.1f} ms, "
                        f"fwd+bwd {'n/a' if bwd is None else f'{bwd:.1f} ms'}, rel err {err:.1e}")

    by = {(r["T"], r["method"]): r for r in rows}
    base = "flashkda_cpp" if "flashkda_cpp" in methods else "naive"
    table = Table(title=f"KDA on CPU, fp32, B={B} H={H} K=V={K}: median {'CPU' if args.cpu_time else 'wall'} ms "
                        f"({torch.get_num_threads()} threads, "
                        f"load {load_start[0]:.1f} at start)")
    for col in ("T", "method", "fwd ms", "GFLOP/s", "of peak", f"{base}/this", "naive/this", "single/this",
                "fwd+bwd ms", f"{base}/this", "naive/this", "single/this", "rel err"):
        table.add_column(col, justify="right")

    def ratio(num: dict | None, den: dict, key: str) -> str:
        a, b = (None if num is None else num[key]), den[key]
        return "n/a" if a is None or b is None else f"{a / b:.2f}x"

    for r in rows:
        ref_rows = [by.get((r["T"], m)) for m in (base, "naive", "single16")]
        bwd = r["fwd_bwd_ms"]
        rate = ("n/a", "n/a") if r["fwd_gflops"] is None else (f"{r['fwd_gflops']:.1f}",
                                                              f"{r['fwd_fraction_of_peak']:.0%}")
        table.add_row(str(r["T"]), r["method"], f"{r['fwd_ms']:.1f}", *rate, *(ratio(m, r, "fwd_ms") for m in ref_rows),
                      "n/a" if bwd is None else f"{bwd:.1f}", *(ratio(m, r, "fwd_bwd_ms") for m in ref_rows),
                      f"{r['rel_err_vs_fp64']:.1e}")
    console.print(table)
    peak_text = ", ".join(f"T={T}: {p:.1f}" for T, p in peaks.items())
    console.print(f"fp32 matmul peak ({PEAK_N}^2, timed in the same rounds): {peak_text} GFLOP/s")

    memory = []
    state = kda_state_bytes(H, K, batch=1)
    mem_table = Table(title=f"Decode memory per layer, H={H} heads x {K}: KDA state (S fp32 + conv tail bf16) "
                            "vs full-attention KV cache (bf16)")
    for col in ("context", "KDA state", "KV cache", "KV / KDA"):
        mem_table.add_column(col, justify="right")
    for name, tokens in CONTEXTS.items():
        kv = kv_cache_bytes(H, K, tokens)
        memory.append({"context": name, "tokens": tokens, "kda_state_bytes": state, "kv_cache_bytes": kv})
        mem_table.add_row(name, f"{state / 2**10:.0f} KiB", f"{kv / 2**20:.0f} MiB", f"{kv / state:.0f}x")
    console.print(mem_table)

    claims: dict[str, object] = {}
    if 4096 in lengths and {"chunk16", "chunk16_act", "naive", "single16"} <= set(methods):  # else a partial run
        claims = _claims(by, lengths, peaks, methods)
        console.print(claims)
    RESULTS.mkdir(exist_ok=True)
    out = {"config": {"B": B, "H": H, "K": K, "V": V, "dtype": "float32", "gate": "safe, lower_bound -5",
                      "target_ms": TARGET_MS, "repeats": args.repeats},
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "threads": torch.get_num_threads(), "clock": "cpu" if args.cpu_time else "wall",
                       "load_avg_at_start": load_start,
                       "load_avg_at_end": os.getloadavg(), "shared": "other jobs ran on the same cores"},
           "baselines": notes, "timings": rows, "memory": memory, "claims": claims}
    (RESULTS / args.output).write_text(json.dumps(out, indent=2) + "\n")
    console.log(f"wrote {RESULTS / args.output}")


if __name__ == "__main__":
    main()
