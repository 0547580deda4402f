"""Argument checks shared by every KDA op (naive, chunked, step, Triton), so all reject the same input."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KDADims:
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int  # number of sequences: B, or len(cu_seqlens) - 1


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {what} = {list(expected)}, got {list(x.shape)}")


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_head_dim: int | None = None,
) -> KDADims:
    """Validate the sequence-op arguments and return their dimensions.

    Shapes: q, k, g `[B, T, H, K]`; v `[B, T, H, V]`; beta `[B, T, H]`; initial_state `[N, H, K, V]`;
    cu_seqlens `[N + 1]` int64 with B == 1. Raises ValueError naming the offending argument.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, H, *], got {x.dim()}-D shape {list(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    _shape("k", k, (B, T, H, K), "[B, T, H, K]")
    _shape("g", g, (B, T, H, K), "[B, T, H, K]")
    _shape("v", v, (B, T, H, V), "[B, T, H, V]")
    _shape("beta", beta, (B, T, H), "[B, T, H]")
    if min(T, H, K, V) == 0 or B == 0:
        raise ValueError(f"q/v must be non-empty, got q {list(q.shape)} and v {list(v.shape)}")
    if max_head_dim is not None and max(K, V) > max_head_dim:
        raise ValueError(f"expected K, V <= {max_head_dim}, got K={K}, V={V}")
    if g.max() > 0:
        raise ValueError(f"g is a log-decay and must be <= 0, got max {g.max().item():.4g}")
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"cu_seqlens must be a 1-D int64 tensor, got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens packs sequences along T, so B must be 1, got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens needs at least 2 entries [0, ..., T], got {cu_seqlens.tolist()}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu[0]} ... {cu[-1]}")
        if any(b <= a for a, b in zip(cu, cu[1:], strict=False)):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {cu}")
        N = len(cu) - 1
    if initial_state is not None:
        _shape("initial_state", initial_state, (N, H, K, V), "[N, H, K, V]")
    return KDADims(B, T, H, K, V, N)


def compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """fp64 if any input is fp64 (the oracle mode), else fp32 (accumulation for fp32/bf16/fp16)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def sequence_spans(dims: KDADims, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of each of the N sequences."""
    if cu_seqlens is None:
        return [(b, 0, dims.T) for b in range(dims.B)]
    cu = cu_seqlens.tolist()
    return [(0, cu[n], cu[n + 1]) for n in range(dims.N)]
