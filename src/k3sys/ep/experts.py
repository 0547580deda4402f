"""Grouped expert compute: a GEMM per contiguous row group, the SwiGLU expert built on it, and the
weighted sum of each token's expert outputs.

Rows of `x` are grouped by expert (group g owns rows `[ends[g-1], ends[g])`), the layout both the
single-process MoE layer and `EPBuffer.dispatch` produce, so one call runs every local expert. The
weights of the groups may come as several tensors taken in order (the expert-parallel layer's home
experts, then its replica slots), so no step has to concatenate weights (a copy of every one).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

Weights = torch.Tensor | Sequence[torch.Tensor]


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


def grouped_mm(x: torch.Tensor, w: Weights, ends: Sequence[int]) -> torch.Tensor:
    """`x[rows of g] @ w[g]` for every group g.

    Args:
        x: `[n, k]` rows grouped by expert.
        w: `[G, k, m]` one weight per group, or a sequence of `[G_i, k, m]` tensors whose groups are
            taken in order (G = sum G_i).
        ends: `[G]` cumulative row ends, non-decreasing, `ends[-1] <= n` (host ints: the slicing needs
            them). G may be 0.

    Returns:
        `[n, m]`; rows at or past `ends[-1]` belong to no group: zeros on the CPU loop, unspecified on
        the CUDA kernel. Callers never read them.
    """
    ws = (w,) if isinstance(w, torch.Tensor) else tuple(w)
    if len(ends) != sum(t.shape[0] for t in ws):
        raise ValueError(f"ends has {len(ends)} groups but w has {sum(t.shape[0] for t in ws)}")
    if ends and all(_use_torch_grouped_mm(x, t) for t in ws):
        return _torch_grouped_mm(x, ws, ends)
    return _LoopGroupedMM.apply(x, tuple(ends), *ws)


def _torch_grouped_mm(x: torch.Tensor, ws: tuple[torch.Tensor, ...], ends: Sequence[int]) -> torch.Tensor:
    """One `torch._grouped_mm` per weight tensor over its rows (CUDA)."""
    if len(ws) == 1:
        return torch._grouped_mm(x, ws[0], offs=torch.tensor(ends, dtype=torch.int32, device=x.device))
    outs, first_group, first_row = [], 0, 0
    for t in ws:
        last_group = first_group + t.shape[0]
        if last_group > first_group:
            offs = torch.tensor(ends[first_group:last_group], dtype=torch.int32, device=x.device) - first_row
            outs.append(torch._grouped_mm(x[first_row:ends[last_group - 1]], t, offs=offs))
            first_row = ends[last_group - 1]
        first_group = last_group
    return torch.cat([*outs, x.new_zeros(x.shape[0] - first_row, ws[0].shape[2])])


class _LoopGroupedMM(torch.autograd.Function):
    """One `mm` per group, each writing straight into its rows of the output (and of the gradients):
    no per-group temporaries to concatenate or stack, and empty groups cost nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: tuple[int, ...], *ws: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *ws)
        ctx.ends = ends
        out = x.new_empty(x.shape[0], ws[0].shape[2])
        for (a, b), (w, _) in zip(_ranges(ends), _per_group(ws), strict=True):
            torch.mm(x[a:b], w, out=out[a:b])
        out[_end(ends):].zero_()
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *ws = ctx.saved_tensors
        ends = ctx.ends
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_ws = [torch.empty_like(w) if needed else None for w, needed in zip(ws, ctx.needs_input_grad[2:],
                                                                                 strict=True)]
        for (a, b), (w, grad_w) in zip(_ranges(ends), _per_group(ws, grad_ws), strict=True):
            if grad_x is not None:
                torch.mm(grad_out[a:b], w.t(), out=grad_x[a:b])
            if grad_w is not None:
                torch.mm(x[a:b].t(), grad_out[a:b], out=grad_w)  # an empty group gives zeros
        if grad_x is not None:
            grad_x[_end(ends):].zero_()
        return grad_x, None, *grad_ws


def _per_group(
    ws: Sequence[torch.Tensor], grad_ws: Sequence[torch.Tensor | None] | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight `[k, m]`, its slot in the gradient or None) of each group, through the tensors in order."""
    for i, w in enumerate(ws):
        grad_w = None if grad_ws is None else grad_ws[i]
        yield from zip(w.unbind(0), grad_w.unbind(0) if grad_w is not None else [None] * w.shape[0], strict=True)


def _ranges(ends: Sequence[int]) -> zip:
    """(start, end) row range of each group."""
    return zip((0, *ends), ends, strict=False)  # one start more than ends; zip drops it


def _end(ends: Sequence[int]) -> int:
    return ends[-1] if ends else 0


def grouped_swiglu(
    x: torch.Tensor, ends: Sequence[int], w_gate: Weights, w_up: Weights, w_down: Weights
) -> torch.Tensor:
    """SwiGLU experts over grouped rows: `(silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]`.

    Args:
        x: `[n, h]` rows grouped by expert; ends: `[G]` cumulative row ends (see `grouped_mm`).
        w_gate, w_up: `[G, h, f]`; w_down: `[G, f, h]`; each may be a sequence of tensors whose groups
            are taken in order (see `grouped_mm`).

    Returns:
        `[n, h]`; rows past `ends[-1]` are zero.
    """
    # Only the grouped rows: a static buffer sized for the worst case may be mostly tail.
    n, used = x.shape[0], _end(ends)
    x_used = x[:used] if used < n else x
    y = grouped_mm(F.silu(grouped_mm(x_used, w_gate, ends)) * grouped_mm(x_used, w_up, ends), w_down, ends)
    return y if used == n else torch.cat([y, y.new_zeros(n - used, y.shape[1])])


def weighted_sum(weights_sk: torch.Tensor, y_skh: torch.Tensor) -> torch.Tensor:
    """`out[t] = sum_k weights[t, k] * y[t, k]`: weights `[s, K]`, y `[s, K, H]` -> `[s, H]` in y's dtype.

    One batched `[1, K] @ [K, H]` product per token: it reads y once and builds no `[s, K, H]`
    temporary, in forward or backward (half the time of a broadcast multiply and a sum here).
    """
    return torch.bmm(weights_sk.to(y_skh.dtype).unsqueeze(1), y_skh).squeeze(1)
