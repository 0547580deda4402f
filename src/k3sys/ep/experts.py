"""Grouped expert compute: a GEMM per contiguous row group, and the SwiGLU expert built on it.

Rows of `x` are grouped by expert (group g owns rows `[ends[g-1], ends[g])`), the layout both the
single-process MoE layer and `EPBuffer.dispatch` produce, so one call runs every local expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _use_torch_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm is the fused CUDA kernel (bf16, 16-byte aligned strides). Its CPU build runs
    # the forward only (no backward) and is slower than the loop below, so CPU always loops.
    return (
        x.is_cuda
        and hasattr(torch, "_grouped_mm")
        and x.dtype == w.dtype == torch.bfloat16
        and x.shape[1] * x.element_size() % 16 == 0
        and w.shape[2] * w.element_size() % 16 == 0
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: Sequence[int]) -> torch.Tensor:
    """`x[rows of g] @ w[g]` for every group g.

    Args:
        x: `[n, k]` rows grouped by expert.
        w: `[G, k, m]` one weight per group.
        ends: `[G]` cumulative row ends, non-decreasing, `ends[-1] <= n` (host ints: the slicing needs them).

    Returns:
        `[n, m]`; rows at or past `ends[-1]` belong to no group: zeros on the CPU loop, unspecified on
        the CUDA kernel. Callers never read them.
    """
    if len(ends) != w.shape[0]:
        raise ValueError(f"ends has {len(ends)} groups but w has {w.shape[0]}")
    if _use_torch_grouped_mm(x, w):
        offs = torch.tensor(ends, dtype=torch.int32, device=x.device)
        return torch._grouped_mm(x, w, offs=offs)
    sizes = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)] + [x.shape[0] - ends[-1]]
    # split/unbind give one backward node each; slicing or w[g] per group would build a full-size
    # zero gradient per group and make the backward quadratic in the number of groups.
    xs = x.split(sizes)
    out = [xg @ wg for xg, wg in zip(xs, w.unbind(0), strict=False)]
    return torch.cat([*out, x.new_zeros(sizes[-1], w.shape[2])])


def grouped_swiglu(
    x: torch.Tensor, ends: Sequence[int], w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over grouped rows: `(silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]`.

    Args:
        x: `[n, h]` rows grouped by expert; ends: `[G]` cumulative row ends (see `grouped_mm`).
        w_gate, w_up: `[G, h, f]`; w_down: `[G, f, h]`.

    Returns:
        `[n, h]`; rows past `ends[-1]` as in `grouped_mm`.
    """
    return grouped_mm(F.silu(grouped_mm(x, w_gate, ends)) * grouped_mm(x, w_up, ends), w_down, ends)
