"""Argument checks shared by every KDA op (naive, chunked, step, Triton), so all reject the same input."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The one limit on head dims for every entry point (naive, chunk, step, layer): the torch ops' tiles and
# the fp32 state of a decode step stay within what was tested; Triton's own, lower bound is its own check.
MAX_HEAD_DIM = 512


class NaNError(ValueError):
    """A NaN where a KDA op needs a number (so a layer can name where it came from)."""


@dataclass(frozen=True)
class KDADims:
    B: int
    T: int
    H: int  # q/k heads
    K: int
    V: int
    N: int  # number of sequences: B, or len(cu_seqlens) - 1
    HV: int  # value heads (v, g, beta, state): a multiple of H (grouped value attention)


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
    max_head_dim: int = MAX_HEAD_DIM,
    state_v_first: bool = False,
) -> KDADims:
    """Validate the sequence-op arguments' shapes and return their dimensions (g's values: `check_log_decay`).

    Shapes: q, k `[B, T, H, K]`; v `[B, T, HV, V]`; g `[B, T, HV, K]`; beta `[B, T, HV]`; initial_state
    `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`); cu_seqlens `[N + 1]` int64/int32, non-decreasing
    from 0 to T (empty sequences allowed), with B == 1. T may be 0. Pass the host copy of cu_seqlens when
    there is one (fla's `cu_seqlens_cpu`): it is read here. Raises ValueError naming the offending argument.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, H, *], got {x.dim()}-D shape {list(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is not None and not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _shape("k", k, (B, T, H, K), "[B, T, H, K]")
    check_heads(H, K, HV, V, max_head_dim)
    _shape("v", v, (B, T, HV, V), "[B, T, HV, V]")
    _shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    _shape("beta", beta, (B, T, HV), "[B, T, HV]")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens packs sequences along T, so B must be 1, got B={B}")
        N = check_cu_seqlens(cu_seqlens, T)
    if initial_state is not None:
        if state_v_first:
            _shape("initial_state", initial_state, (N, HV, V, K), "[N, HV, V, K] (state_v_first)")
        else:
            _shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
    return KDADims(B, T, H, K, V, N, HV)


def check_heads(H: int, K: int, HV: int, V: int, max_head_dim: int = MAX_HEAD_DIM) -> None:
    """The head counts and dims every op accepts (q/k: H heads of K; v: HV heads of V)."""
    if min(H, K, V, HV) == 0:
        raise ValueError(f"q/v must have heads and head dims, got H={H}, K={K}, HV={HV}, V={V}")
    if HV % H:
        raise ValueError(f"v's heads HV={HV} must be a multiple of q/k's heads H={H} (grouped value attention)")
    if max(K, V) > max_head_dim:
        raise ValueError(f"expected K, V <= {max_head_dim}, got K={K}, V={V}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> int:
    """Check `[N + 1]` packed-sequence offsets against T tokens (reads the values: pass a host copy);
    return N."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cu_seqlens must be a 1-D int64 tensor, got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries [0, ..., T], got {cu_seqlens.tolist()}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu[0]} ... {cu[-1]}")
    if any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    return len(cu) - 1


def check_log_decay(g: torch.Tensor) -> None:
    """g (activated) must be a log-decay: <= 0, -inf allowed (an exact reset), no NaN. Reads g once."""
    if g.numel() == 0:
        return
    g_min, g_max = (x.item() for x in torch.aminmax(g))  # one pass; NaN propagates into both
    if math.isnan(g_min) or math.isnan(g_max):
        raise NaNError("g must not be NaN")
    if g_max > 0:
        raise ValueError(f"g is a log-decay and must be <= 0: each step scales the state by exp(g), and exp(g) > 1 "
                         f"would amplify it without bound; got max {g_max:.4g}")


def compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """fp64 if any input is fp64 (the oracle mode), else fp32 (accumulation for fp32/bf16/fp16)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def sequence_spans(dims: KDADims, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of each of the N sequences."""
    if cu_seqlens is None:
        return [(b, 0, dims.T) for b in range(dims.B)]
    cu = cu_seqlens.tolist()
    return [(0, cu[n], cu[n + 1]) for n in range(dims.N)]


def resolve_cu_seqlens(
    cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(cu_seqlens on `device`, the copy host-side checks read): fla's pair, either one may be given alone.

    Given both, the host copy is what the caller promises and what the checks read, so it is also what
    the kernels read: on the host the two are compared (a mismatch is refused); on a device, where the
    comparison would be a sync, the device copy is rebuilt from the host one (a copy of N + 1 ints, no
    sync), so checks and kernels can never disagree and no offset past T reaches a kernel.
    """
    if cu_seqlens_cpu is None:
        return cu_seqlens, cu_seqlens
    if cu_seqlens is not None:
        if cu_seqlens.shape != cu_seqlens_cpu.shape:
            raise ValueError(f"cu_seqlens and cu_seqlens_cpu must be the same offsets, got shapes "
                             f"{list(cu_seqlens.shape)} and {list(cu_seqlens_cpu.shape)}")
        if cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens.long(), cu_seqlens_cpu.long()):
            raise ValueError(f"cu_seqlens and cu_seqlens_cpu must be the same offsets, got {cu_seqlens.tolist()} "
                             f"and {cu_seqlens_cpu.tolist()}")
    return cu_seqlens_cpu.to(device, non_blocking=True), cu_seqlens_cpu
