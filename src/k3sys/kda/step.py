"""One-token KDA decode step on a fixed-size state: the per-token cost that makes long contexts cheap."""

from __future__ import annotations

import torch

from k3sys.kda.activations import activate, expand_heads, kda_options, prepare, state_in, state_out
from k3sys.kda.validate import compute_dtype


def delta_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence for one token, in the caller's dtype, q already scaled; shapes as in `kda_step`."""
    S = S * g.exp().unsqueeze(-1)
    # (I - b k k^T) D S + b k v^T  ==  D S + k (b (v - (D S)^T k))^T
    u = beta.unsqueeze(-1) * (v - torch.einsum("...k,...kv->...v", k, S))
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("...k,...kv->...v", q, S), S


def _check_step_ranks(q, k, v, g, beta, state, state_v_first: bool) -> None:
    for name, x, rank, what in (("q", q, 3, "[N, H, K]"), ("k", k, 3, "[N, H, K]"), ("v", v, 3, "[N, HV, V]"),
                                ("g", g, 3, "[N, HV, K]"), ("beta", beta, 2, "[N, HV]"),
                                ("state", state, 4, "[N, HV, K, V]")):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            got = f"{x.dim()}-D shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be {rank}-D {what} (one token per sequence), got {got}")
        if not x.is_floating_point():  # an integer state would be cast and truncated silently
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    N, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    for name, x, want in (("k", k, (N, H, K)), ("g", g, (N, HV, K)), ("v", v, (N, HV, V)), ("beta", beta, (N, HV))):
        if tuple(x.shape) != want:  # before check_inputs, which would word it in [B, T, ...] terms
            raise ValueError(f"{name} must have shape {list(want)} to match q {list(q.shape)} and v {list(v.shape)}, "
                             f"got {list(x.shape)}")
    want, what = ((N, HV, V, K), "[N, HV, V, K] (state_v_first)") if state_v_first else ((N, HV, K, V), "[N, HV, K, V]")
    if tuple(state.shape) != want:
        raise ValueError(f"state must have shape {what} = {list(want)}, got {list(state.shape)}")


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance N sequences by one token each; the same math as `kda_naive` for T = 1.

    Args:
        q, k: `[N, H, K]`, used as given unless `use_qk_l2norm_in_kernel`.
        v: `[N, HV, V]`, HV a multiple of H (grouped value attention).
        g: `[N, HV, K]` natural-log decay of this step, <= 0 (-inf resets); raw with `use_gate_in_kernel`.
        beta: `[N, HV]`, activated unless `use_beta_sigmoid_in_kernel`.
        state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`) the state before this token (fp32, or
            fp64 in oracle mode). Not modified.
        scale: query scale, default `K ** -0.5`.
        **options: `k3sys.kda.activations.KDAOptions` (fla's / FlashKDA's names).

    Returns:
        o `[N, HV, V]` in v's dtype, and the new state in the compute dtype, in `state`'s shape (so a cache
        can copy it into preallocated storage).
    """
    opts = kda_options(**options)
    _check_step_ranks(q, k, v, g, beta, state, opts.state_v_first)
    p = prepare(*(x.unsqueeze(1) for x in (q, k, v, g, beta)), scale, state, None, None, opts)
    o, S = delta_update(p.q[:, 0] * p.scale, p.k[:, 0], p.v[:, 0], p.g[:, 0], p.beta[:, 0], p.S0)
    return o.to(v.dtype), state_out(S, opts)


def step_unchecked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    scale: float | None = None, **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_step` (same arguments, options and results) without its input checks, for a caller whose
    shapes are its own and whose gate is in range by construction (the layer): the checks read g's range,
    which on a GPU is a device sync per layer per decoded token."""
    opts = kda_options(**options)
    dt = compute_dtype(q, k, v, g, beta, state)
    q, k, g, beta = activate(q, k, g, beta, opts, dt)
    q, k = (expand_heads(x[:, None], v.shape[-2])[:, 0] for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, S = delta_update(q * scale, k, v.to(dt), g, beta, state_in(state, opts).to(dt))
    return o.to(v.dtype), state_out(S, opts)
