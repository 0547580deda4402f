"""Random KDA inputs for the tests: L2-normalised q, k; g from the real gate; beta in (0, 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3sys.kda import kda_gate

GATES = ("safe", "plain", "huge")


def make_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.float64, gate: str = "safe",
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, g `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]` in `dtype`.

    gate: "safe" (lower bound -5), "plain" (unbounded, moderate), or "huge": the plain gate plus, at about
    one token in 20 per head, a step between -50 and -5000, so some 16-token blocks span far beyond exp's
    range in fp32 and fp64 (the pairwise path runs) while others do not.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
    v, f = randn(B, T, H, V), randn(B, T, H, K)
    A_log, dt_bias = 0.5 * randn(H), 0.5 * randn(H, K)
    if gate == "safe":
        g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    elif gate == "plain":
        g = kda_gate(f, A_log, dt_bias)
    elif gate == "huge":
        hit = torch.rand(B, T, H, 1, generator=gen, dtype=torch.float64) < 0.05
        spike = torch.empty(B, T, H, 1, dtype=torch.float64).uniform_(50, 5000, generator=gen)
        g = kda_gate(f, A_log, dt_bias) - hit * spike
    else:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()
