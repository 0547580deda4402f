"""KDA gate parameterisations: per-channel log-decay g <= 0 from the gate projection f."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def check_lower_bound(lower_bound: float | None, safe: bool = True) -> None:
    """Raise ValueError unless `lower_bound` is None (plain gate) or negative; with `safe`, in [-5, 0).

    [-5, 0) is the safe gate's range: 16 steps then stay within exp(-80), inside fp32 (fla's `safe_gate`).
    """
    if lower_bound is None:
        return
    if safe and not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound must be None or in [-5, 0), got {lower_bound}")
    if not -math.inf < lower_bound < 0.0:
        raise ValueError(f"lower_bound must be None or a finite negative float, got {lower_bound}")


def check_gate(H: int, K: int, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
               lower_bound: float | None, safe: bool = True) -> None:
    """Raise ValueError unless the gate's parameters fit H heads of K channels (see `kda_gate`)."""
    if A_log is None and lower_bound is None:
        raise ValueError("A_log is required for the softplus gate (lower_bound=None)")
    if A_log is not None and A_log.shape != (H,):
        raise ValueError(f"A_log must have shape [H] = [{H}], got {list(A_log.shape)}")
    if dt_bias is not None and dt_bias.shape not in ((H, K), (H * K,)):
        raise ValueError(f"dt_bias must have shape [H, K] = [{H}, {K}] or [H * K] = [{H * K}], "
                         f"got {list(dt_bias.shape)}")
    check_lower_bound(lower_bound, safe)


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None = None,
    safe: bool = True,
) -> torch.Tensor:
    """Log-decay g from the gate projection, in fp32 (fp64 when f is fp64).

    Args:
        f: `[..., H, K]` gate pre-activation.
        A_log: `[H]` per-head log decay rate; None (only with `lower_bound`) means a rate of 1.
        dt_bias: `[H, K]` (or fla's flat `[H * K]`) per-channel bias, None for none.
        lower_bound: None for the plain gate `-exp(A_log) * softplus(f + dt_bias)` (unbounded below);
            a negative float for the bounded gate `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`,
            which keeps every step in [lower_bound, 0]. In [-5, 0) (the safe gate) a 16-token chunk's
            cumulative decay stays within e^(16 * lower_bound), inside bf16/fp32 range.
        safe: require `lower_bound` in [-5, 0) (else any negative float).

    Returns:
        g `[..., H, K]` fp32 (fp64 for fp64 f), <= 0.
    """
    H, K = f.shape[-2], f.shape[-1]
    check_gate(H, K, A_log, dt_bias, lower_bound, safe)
    dt = torch.promote_types(f.dtype, torch.float32)  # fp32, or fp64 in oracle mode
    f = f.to(dt)
    A = None if A_log is None else A_log.to(dt).exp().unsqueeze(-1)  # [H, 1]
    b = None if dt_bias is None else dt_bias.to(dt).view(H, K)
    if lower_bound is None:
        return -A * F.softplus(f if b is None else f + b)
    if A is not None and b is not None:  # A (f + b) as A f + (A b): one fused pass over f, A b is only [H, K]
        return lower_bound * torch.sigmoid(torch.addcmul(A * b, f, A))
    z = f if b is None else f + b
    return lower_bound * torch.sigmoid(z if A is None else A * z)
