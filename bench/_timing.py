"""Wall-clock timing shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], repeats: int, threads: int | None = None,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median wall time (or `clock`'s, e.g. time.process_time for CPU time) of `fn` in ms over `repeats`
    calls after one warm-up call, with torch's intra-op threads set to `threads` for the duration (None:
    leave them as they are)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        fn()
        times = []
        for _ in range(repeats):
            t0 = clock()
            fn()
            times.append(clock() - t0)
    finally:
        torch.set_num_threads(before)
    return 1e3 * statistics.median(times)
