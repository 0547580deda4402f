"""Launch-time tuning: Triton's autotuner on GPUs, fixed heuristic meta-parameters everywhere else.

On a GPU each tunable kernel times its small search space once per (H, K, V) and keeps the fastest; the
kernels overwrite their outputs, so the trial launches are harmless. In the interpreter (no GPU to time)
or with K3SYS_TRITON_AUTOTUNE=0 (the tests, which would otherwise tune every test shape) a launch uses
the caller's heuristic defaults instead.
"""

from __future__ import annotations

import itertools
import os

import triton

LAUNCH_OPTIONS = ("num_warps", "num_stages")


class TunedKernel:
    """A Triton kernel whose meta-parameters in `space` are autotuned on GPUs or given as defaults."""

    def __init__(self, kernel, interpreted: bool, key: tuple[str, ...] = ("H", "K", "V"), **space: tuple):
        self.kernel = kernel
        self.names = tuple(space)
        self.tuned = None
        if not interpreted and os.environ.get("K3SYS_TRITON_AUTOTUNE", "1") != "0":
            configs = []
            for values in itertools.product(*space.values()):
                point = dict(zip(self.names, values, strict=True))
                options = {name: point.pop(name) for name in LAUNCH_OPTIONS if name in point}
                configs.append(triton.Config(point, **options))
            self.tuned = triton.autotune(configs=configs, key=list(key))(kernel)

    def __getitem__(self, grid):
        """`kernel[grid](*args, defaults=..., **meta)`: defaults hold the tuned names' untuned values."""

        def launch(*args, defaults: dict, **meta):
            if set(defaults) != set(self.names):
                raise ValueError(f"defaults must give {self.names}, got {tuple(defaults)}")
            if self.tuned is not None:
                return self.tuned[grid](*args, **meta)
            return self.kernel[grid](*args, **meta, **defaults)

        return launch
