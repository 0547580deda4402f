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
        ends: `[G]` cumulative row ends, non-decreasing, `ends[-1] <= n` (host ints: the slicing needs
            them). G may be 0.

    Returns:
        `[n, m]`; rows at or past `ends[-1]` belong to no group: zeros on the CPU loop, unspecified on
        the CUDA kernel. Callers never read them.
    """
    if len(ends) != w.shape[0]:
        raise ValueError(f"ends has {len(ends)} groups but w has {w.shape[0]}")
    if _use_torch_grouped_mm(x, w) and ends:
        offs = torch.tensor(ends, dtype=torch.int32, device=x.device)
        return torch._grouped_mm(x, w, offs=offs)
    return _LoopGroupedMM.apply(x, w, tuple(ends))


class _LoopGroupedMM(torch.autograd.Function):
    """One `mm` per group, each writing straight into its rows of the output (and of the gradients):
    no per-group temporaries to concatenate or stack, and empty groups cost nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, ends: tuple[int, ...]) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.ends = ends
        out = x.new_empty(x.shape[0], w.shape[2])
        for g, (a, b) in enumerate(_ranges(ends)):
            torch.mm(x[a:b], w[g], out=out[a:b])
        out[_end(ends):].zero_()
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        ends = ctx.ends
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for g, (a, b) in enumerate(_ranges(ends)):
            if grad_x is not None:
                torch.mm(grad_out[a:b], w[g].t(), out=grad_x[a:b])
            if grad_w is not None:
                torch.mm(x[a:b].t(), grad_out[a:b], out=grad_w[g])  # an empty group gives zeros
        if grad_x is not None:
            grad_x[_end(ends):].zero_()
        return grad_x, grad_w, None


def _ranges(ends: Sequence[int]) -> zip:
    """(start, end) row range of each group."""
    return zip((0, *ends), ends, strict=False)  # one start more than ends; zip drops it


def _end(ends: Sequence[int]) -> int:
    return ends[-1] if ends else 0


def grouped_swiglu(
    x: torch.Tensor, ends: Sequence[int], w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over grouped rows: `(silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]`.

    Args:
        x: `[n, h]` rows grouped by expert; ends: `[G]` cumulative row ends (see `grouped_mm`).
        w_gate, w_up: `[G, h, f]`; w_down: `[G, f, h]`.

    Returns:
        `[n, h]`; rows past `ends[-1]` are zero.
    """
    # Only the grouped rows: a static buffer sized for the worst case may be mostly tail.
    n, used = x.shape[0], _end(ends)
    x_used = x[:used] if used < n else x
    y = grouped_mm(F.silu(grouped_mm(x_used, w_gate, ends)) * grouped_mm(x_used, w_up, ends), w_down, ends)
    return y if used == n else torch.cat([y, y.new_zeros(n - used, y.shape[1])])
