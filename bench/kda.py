"""Claim: the two-phase chunked KDA forward at T=4096 (B=1, H=4, K=V=128, fp32, CPU) takes <= 100 ms
where the token-by-token recurrence takes over 1 s; the two-phase form (all intra-chunk work in one
batched pass, then the chunk loop) beats a single loop that does each chunk's intra-chunk work inside
the loop (the CPU version of FlashKDA's two-kernel claim); and the decode state stays the same size
while a full-attention KV cache of the same heads grows with the context.

Sweep: T in {1024, 4096, 16384}; forward and forward+backward (the naive loop's backward only up to
T = 4096: its graph would hold ~12 GB at 16384); naive, chunk C=16/32/64, single-loop C=16. Writes
bench/results/kda.json.

    PYTHONPATH=src python bench/kda.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from _timing import median_ms
from k3sys.kda import kda_chunk, kda_gate, kda_naive, kda_state_bytes, kv_cache_bytes
from k3sys.kda.chunk import chunk_layout, from_slots, inter_chunk_step, intra_chunk, to_slots

RESULTS = Path(__file__).parent / "results"
B, H, K, V = 1, 4, 128, 128
TARGET_MS = 100.0
CONTEXTS = {"4K": 4096, "128K": 131072, "1M": 1048576}
# The token loop's autograd graph keeps about 0.75 MB of state copies per token at this size (12 GB at
# T = 16384), so its backward is only measured up to here.
NAIVE_BACKWARD_MAX_T = 4096


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


METHODS: dict[str, Callable[..., torch.Tensor]] = {
    "naive": lambda *xs: kda_naive(*xs)[0],
    "chunk16": lambda *xs: kda_chunk(*xs, chunk_size=16)[0],
    "chunk32": lambda *xs: kda_chunk(*xs, chunk_size=32)[0],
    "chunk64": lambda *xs: kda_chunk(*xs, chunk_size=64)[0],
    "single16": lambda *xs: kda_chunk_single_loop(*xs, chunk_size=16),
}


def make_inputs(T: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = kda_gate(torch.randn(B, T, H, K, generator=gen), torch.randn(H, generator=gen),
                 torch.randn(H, K, generator=gen), lower_bound=-5.0)
    beta = torch.rand(B, T, H, generator=gen)
    return [q, k, v, g, beta]


def timed(method: str, xs: list[torch.Tensor], backward: bool, repeats: int) -> float:
    fn = METHODS[method]
    if not backward:
        return median_ms(lambda: fn(*xs), repeats)
    leaves = [x.clone().requires_grad_() for x in xs]
    w = torch.randn_like(xs[2])
    return median_ms(lambda: (fn(*leaves) * w).sum().backward(), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T in {1024, 4096} only, fewer repeats")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = (1024, 4096) if args.quick else (1024, 4096, 16384)
    console = Console(width=160)

    rows = []
    for T in lengths:
        xs = make_inputs(T)
        ref = kda_naive(*(x.double() for x in xs))[0]
        for method in METHODS:
            err = ((METHODS[method](*xs).double() - ref).norm() / ref.norm()).item()
            # the recurrence costs seconds per call at long T: fewer repeats there
            reps = max(1, args.repeats // 3) if method == "naive" and T >= 4096 else args.repeats
            fwd = timed(method, xs, backward=False, repeats=reps)
            bwd = (None if method == "naive" and T > NAIVE_BACKWARD_MAX_T
                   else timed(method, xs, backward=True, repeats=1 if method == "naive" else reps))
            rows.append({"T": T, "method": method, "fwd_ms": fwd, "fwd_bwd_ms": bwd, "rel_err_vs_fp64": err})
            bwd_txt = "n/a" if bwd is None else f"{bwd:.1f} ms"
            console.log(f"T={T} {method}: fwd {fwd:.1f} ms, fwd+bwd {bwd_txt}, rel err {err:.1e}")

    by = {(r["T"], r["method"]): r for r in rows}
    table = Table(title=f"KDA on CPU, fp32, B={B} H={H} K=V={K}: median ms ({torch.get_num_threads()} threads)")
    for col in ("T", "method", "fwd ms", "naive/this", "single/this", "fwd+bwd ms", "naive/this", "single/this",
                "rel err"):
        table.add_column(col, justify="right")
    def ratio(num: float | None, den: float | None, fmt: str) -> str:
        return "n/a" if num is None or den is None else f"{num / den:{fmt}}x"

    for r in rows:
        naive, single = by[(r["T"], "naive")], by[(r["T"], "single16")]
        bwd = r["fwd_bwd_ms"]
        table.add_row(str(r["T"]), r["method"], f"{r['fwd_ms']:.1f}", ratio(naive["fwd_ms"], r["fwd_ms"], ".1f"),
                      ratio(single["fwd_ms"], r["fwd_ms"], ".2f"), "n/a" if bwd is None else f"{bwd:.1f}",
                      ratio(naive["fwd_bwd_ms"], bwd, ".1f"), ratio(single["fwd_bwd_ms"], bwd, ".2f"),
                      f"{r['rel_err_vs_fp64']:.1e}")
    console.print(table)

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

    at4k = by[(4096, "chunk16")]["fwd_ms"]
    claims = {
        "chunk16_fwd_T4096_ms": at4k,
        "chunk16_fwd_T4096_within_target": at4k <= TARGET_MS,
        "naive_fwd_T4096_ms": by[(4096, "naive")]["fwd_ms"],
        "two_phase_beats_single_loop": all(by[(T, "chunk16")][p] < by[(T, "single16")][p]
                                           for T in lengths for p in ("fwd_ms", "fwd_bwd_ms")),
    }
    console.print(claims)
    RESULTS.mkdir(exist_ok=True)
    out = {"config": {"B": B, "H": H, "K": K, "V": V, "dtype": "float32", "gate": "safe, lower_bound -5",
                      "target_ms": TARGET_MS, "repeats": args.repeats},
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "threads": torch.get_num_threads(), "load_avg_1m_at_end": os.getloadavg()[0]},
           "timings": rows, "memory": memory, "claims": claims}
    (RESULTS / "kda.json").write_text(json.dumps(out, indent=2) + "\n")
    console.log(f"wrote {RESULTS / 'kda.json'}")


if __name__ == "__main__":
    main()
