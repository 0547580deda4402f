"""KDA gate parameterisations: per-channel log-decay g <= 0 from the gate projection f."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_lower_bound(lower_bound: float | None) -> None:
    """Raise ValueError unless `lower_bound` is None (plain gate) or in [-5, 0) (safe gate)."""
    if lower_bound is not None and not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound must be None or in [-5, 0), got {lower_bound}")


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Log-decay g from the gate projection, in fp32 (fp64 when f is fp64).

    Args:
        f: `[..., H, K]` gate pre-activation.
        A_log: `[H]` per-head log decay rate.
        dt_bias: `[H, K]` per-channel bias.
        lower_bound: None for the plain gate `-exp(A_log) * softplus(f + dt_bias)` (unbounded below);
            a float in [-5, 0) for the safe gate `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`,
            which keeps every step in [lower_bound, 0] so a 16-token chunk's cumulative decay stays
            within e^(16 * lower_bound), inside bf16/fp32 range.

    Returns:
        g `[..., H, K]` fp32 (fp64 for fp64 f), <= 0.
    """
    H, K = f.shape[-2], f.shape[-1]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must have shape [H] = [{H}], got {list(A_log.shape)}")
    if dt_bias.shape != (H, K):
        raise ValueError(f"dt_bias must have shape [H, K] = [{H}, {K}], got {list(dt_bias.shape)}")
    dt = torch.promote_types(f.dtype, torch.float32)  # fp32, or fp64 in oracle mode
    x = f.to(dt) + dt_bias.to(dt)
    A = A_log.to(dt).exp().unsqueeze(-1)
    if lower_bound is None:
        return -A * F.softplus(x)
    check_lower_bound(lower_bound)
    return lower_bound * torch.sigmoid(A * x)
