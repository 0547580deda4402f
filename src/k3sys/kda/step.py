"""One-token KDA decode step on a fixed-size state: the per-token cost that makes long contexts cheap."""

from __future__ import annotations

import torch

from k3sys.kda import fused_step
from k3sys.kda.activations import KDAOptions, activate, cast, expand_heads, kda_options, state_in, state_out
from k3sys.kda.validate import check_heads, check_log_decay, compute_dtype


def delta_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence for one token, in the caller's dtype, q already scaled; shapes as in `kda_step`.

    The differentiable torch formula (the oracle's, and the step's where the fused kernel does not run).
    """
    S = S * g.exp().unsqueeze(-1)
    # (I - b k k^T) D S + b k v^T  ==  D S + k (b (v - (D S)^T k))^T
    u = beta.unsqueeze(-1) * (v - torch.einsum("...k,...kv->...v", k, S))
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("...k,...kv->...v", q, S), S


def _check_step_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, state_v_first: bool) -> None:
    """`validate.check_inputs`' rules for one token per sequence, worded in `[N, ...]` terms, without
    the unsqueezed views a call to it would cost (a third of a small step's time)."""
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
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)} to match q {list(q.shape)} and v {list(v.shape)}, "
                             f"got {list(x.shape)}")
    check_heads(H, K, HV, V)
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
    *,
    inplace: bool = False,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance N sequences by one token each; the same math as `kda_naive` for T = 1.

    Args:
        q, k: `[N, H, K]`, used as given unless `use_qk_l2norm_in_kernel`.
        v: `[N, HV, V]`, HV a multiple of H (grouped value attention).
        g: `[N, HV, K]` natural-log decay of this step, <= 0 (-inf resets); raw with `use_gate_in_kernel`.
        beta: `[N, HV]`, activated unless `use_beta_sigmoid_in_kernel`.
        state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`) the state before this token (fp32, or
            fp64 in oracle mode). Not modified, unless `inplace`.
        scale: query scale, default `K ** -0.5`.
        inplace: write the new state into `state` and return it (a decode cache's buffer): no state-sized
            allocation. `state` must then be contiguous and in the compute dtype (fp32; fp64 if any input
            is fp64). On a bad gate nothing is written.
        **options: `k3sys.kda.activations.KDAOptions` (fla's / FlashKDA's names).

    Returns:
        o `[N, HV, V]` in v's dtype, and the new state in the compute dtype, in `state`'s shape (so a cache
        can copy it into preallocated storage), `state` itself with `inplace`.

    On CPU without autograd the step runs the fused kernel (`fused_step`: one read and one write of the
    state); elsewhere the torch formula `delta_update`.
    """
    opts = kda_options(**options)
    _check_step_inputs(q, k, v, g, beta, state, opts.state_v_first)
    return _step(q, k, v, g, beta, state, scale, opts, inplace, checked=True)


def step_unchecked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    scale: float | None = None, *, inplace: bool = False, **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_step` (same arguments, options and results) without its input checks, for a caller whose
    shapes are its own and whose gate is in range by construction (the layer): the checks read g's range,
    which on a GPU is a device sync per layer per decoded token. (The fused CPU kernel checks the gate
    for free while it reads it, and refuses a bad one here too.)"""
    return _step(q, k, v, g, beta, state, scale, kda_options(**options), inplace, checked=False)


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor, scale: float | None, opts: KDAOptions, inplace: bool, checked: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activate, then the fused kernel where it applies, else the torch formula; shapes as in `kda_step`."""
    dt = compute_dtype(q, k, v, g, beta, state)
    if inplace and (state.dtype != dt or not state.is_contiguous()):
        raise ValueError(f"inplace=True needs a contiguous state in the compute dtype {dt}, got {state.dtype}"
                         f"{'' if state.is_contiguous() else ', non-contiguous'}")
    o_dtype = v.dtype
    q, k, g, beta = activate(q, k, g, beta, opts, dt)
    v = cast(v, dt)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, state))
    if state.device.type == "cpu" and not grad and q.shape[-1] <= fused_step.MAX_K and fused_step.available():
        out = state if inplace else torch.empty_like(state, dtype=dt, memory_format=torch.contiguous_format)
        o = fused_step.fused_step(q, k, v, g, beta, cast(state, dt).contiguous(), out, scale, opts.state_v_first)
        if o is None:  # a positive or NaN gate: the kernel wrote nothing; the check raises and says why
            check_log_decay(g)
        return cast(o, o_dtype), out
    if checked:
        check_log_decay(g)
    q, k = (expand_heads(x[:, None], v.shape[-2])[:, 0] for x in (q, k))
    o, S = delta_update(q * scale, k, v, g, beta, state_in(state, opts).to(dt))
    S = state_out(S, opts)
    return o.to(o_dtype), state.copy_(S) if inplace else S
