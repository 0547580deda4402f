"""`k3sys demo` part for KDA: chunked vs token-by-token speed, and decode state vs KV cache bytes."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from rich.progress import Progress

from k3sys._units import format_bytes
from k3sys.kda.chunk import kda_chunk
from k3sys.kda.gate import kda_gate
from k3sys.kda.naive import kda_naive
from k3sys.kda.state import kda_state_bytes, kv_cache_bytes

# Speed: one sequence, 4 heads of 128, as in bench/kda.py but shorter. Memory: a Kimi Linear KDA layer
# (32 heads x 128).
T, H, D = 2048, 4, 128
LAYER_HEADS, LAYER_DIM = 32, 128
CONTEXTS = {"4K": 4096, "128K": 131072, "1M": 1048576}


def _best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def demo(progress: Progress) -> list[tuple[str, str]]:
    """Run the KDA part and return its (figure, value) rows."""
    task = progress.add_task("KDA: chunked vs naive, state bytes", total=3)
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, D, generator=gen)
    g = kda_gate(torch.randn(1, T, H, D, generator=gen), torch.zeros(H), torch.zeros(H, D), lower_bound=-5.0)
    beta = torch.rand(1, T, H, generator=gen)
    t0 = time.perf_counter()
    o_naive, _ = kda_naive(q, k, v, g, beta)  # one run: it is the slow one, and its output is the reference
    naive_ms = 1e3 * (time.perf_counter() - t0)
    progress.advance(task)
    o_chunk, _ = kda_chunk(q, k, v, g, beta)
    chunk_ms = _best_ms(lambda: kda_chunk(q, k, v, g, beta), 5)
    progress.advance(task)
    err = ((o_chunk - o_naive).norm() / o_naive.norm()).item()
    state = kda_state_bytes(LAYER_HEADS, LAYER_DIM)
    rows = [
        (f"forward T={T}, {H} heads x {D}: naive (token loop)", f"{naive_ms:.0f} ms"),
        ("forward, two-phase chunked (C=16)", f"{chunk_ms:.0f} ms ({naive_ms / chunk_ms:.1f}x faster)"),
        ("chunked vs naive, relative RMS difference", f"{err:.1e}"),
        (f"decode state per KDA layer ({LAYER_HEADS} heads x {LAYER_DIM})", f"{format_bytes(state)} at any context"),
    ]
    for name, tokens in CONTEXTS.items():
        kv = kv_cache_bytes(LAYER_HEADS, LAYER_DIM, tokens)
        rows.append((f"full-attention KV cache, same heads, {name} tokens", f"{format_bytes(kv)} ({kv / state:.0f}x)"))
    progress.advance(task)
    return rows
