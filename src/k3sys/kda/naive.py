"""Token-by-token KDA recurrence: the oracle every fast path is tested against.

Per head, with state S [K, V]:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)
"""

from __future__ import annotations

import torch

from k3sys.kda.step import delta_update
from k3sys.kda.validate import check_inputs, compute_dtype, sequence_spans


def _recurrence(q, k, v, g, beta, S):
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; S [B, H, K, V] -> (o [B, T, H, V], S)."""
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        o[:, t], S = delta_update(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
    return o, S


def kda_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA, one token at a time, in fp32 (fp64 when any input is fp64).

    Args:
        q, k: `[B, T, H, K]`, used as given (callers L2-normalise).
        v: `[B, T, H, V]`.
        g: `[B, T, H, K]` per-step natural-log decay, <= 0.
        beta: `[B, T, H]`, already activated.
        scale: query scale, default `K ** -0.5`.
        initial_state: `[N, H, K, V]`, default zeros.
        output_final_state: return the final state `[N, H, K, V]` (else None).
        cu_seqlens: `[N + 1]` int64 offsets of packed sequences (B must be 1).

    Returns:
        o `[B, T, H, V]` in v's dtype, and the final state in the compute dtype or None.
    """
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    scale = dims.K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    q = q * scale
    S0 = (
        initial_state.to(dt)
        if initial_state is not None
        else torch.zeros(dims.N, dims.H, dims.K, dims.V, dtype=dt, device=q.device)
    )
    if cu_seqlens is None:
        o, S = _recurrence(q, k, v, g, beta, S0)
    else:
        o, states = torch.empty_like(v), []
        for n, (b, s, e) in enumerate(sequence_spans(dims, cu_seqlens)):
            o_n, S_n = _recurrence(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e], g[b:b + 1, s:e],
                                   beta[b:b + 1, s:e], S0[n:n + 1])
            o[b:b + 1, s:e] = o_n
            states.append(S_n)
        S = torch.cat(states)
    return o.to(out_dtype), (S if output_final_state else None)
