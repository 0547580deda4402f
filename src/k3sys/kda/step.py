"""One-token KDA decode step on a fixed-size state: the per-token cost that makes long contexts cheap."""

from __future__ import annotations

import torch

from k3sys.kda.validate import check_inputs, compute_dtype


def delta_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence for one token, in the caller's dtype, q already scaled; shapes as in `kda_step`."""
    S = S * g.exp().unsqueeze(-1)
    # (I - b k k^T) D S + b k v^T  ==  D S + k (b (v - (D S)^T k))^T
    u = beta.unsqueeze(-1) * (v - torch.einsum("...k,...kv->...v", k, S))
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("...k,...kv->...v", q, S), S


def _check_step_ranks(q, k, v, g, beta, state) -> None:
    for name, x, rank, what in (("q", q, 3, "[N, H, K]"), ("k", k, 3, "[N, H, K]"), ("v", v, 3, "[N, H, V]"),
                                ("g", g, 3, "[N, H, K]"), ("beta", beta, 2, "[N, H]"),
                                ("state", state, 4, "[N, H, K, V]")):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            got = f"{x.dim()}-D shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be {rank}-D {what} (one token per sequence), got {got}")
    N, H, K = q.shape
    V = v.shape[-1]
    for name, x, want in (("k", k, (N, H, K)), ("g", g, (N, H, K)), ("v", v, (N, H, V)), ("beta", beta, (N, H))):
        if tuple(x.shape) != want:  # before check_inputs, which would word it in [B, T, ...] terms
            raise ValueError(f"{name} must have shape {list(want)} to match q {list(q.shape)}, got {list(x.shape)}")
    if tuple(state.shape) != (N, H, K, V):
        raise ValueError(f"state must have shape [N, H, K, V] = {[N, H, K, v.shape[-1]]}, got {list(state.shape)}")


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance N sequences by one token each; the same math as `kda_naive` for T = 1.

    Args:
        q, k: `[N, H, K]`, used as given (callers L2-normalise).
        v: `[N, H, V]`.
        g: `[N, H, K]` natural-log decay of this step, <= 0.
        beta: `[N, H]`, already activated.
        state: `[N, H, K, V]` the state before this token (fp32, or fp64 in oracle mode). Not modified.
        scale: query scale, default `K ** -0.5`.

    Returns:
        o `[N, H, V]` in v's dtype, and the new state `[N, H, K, V]` in the compute dtype (same shape as
        `state`, so a cache can copy it into preallocated storage).
    """
    _check_step_ranks(q, k, v, g, beta, state)
    check_inputs(*(x.unsqueeze(1) for x in (q, k, v, g, beta)), initial_state=state)
    return step_unchecked(q, k, v, g, beta, state, scale)


def step_unchecked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_step` without its input checks, for callers that built the inputs themselves (the layer):
    the checks read g's range, which on a GPU is a device sync per layer per decoded token."""
    dt = compute_dtype(q, k, v, g, beta, state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, S = delta_update(q.to(dt) * scale, *(x.to(dt) for x in (k, v, g, beta, state)))
    return o.to(v.dtype), S
