"""Token-by-token KDA recurrence: the oracle every fast path is tested against.

Per head, with state S [K, V]:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3sys.kda.activations import KDAOptions, kda_options
from k3sys.kda.gate import check_gate
from k3sys.kda.step import delta_update
from k3sys.kda.validate import check_inputs, check_log_decay, compute_dtype, resolve_cu_seqlens, sequence_spans


def _activate(q, k, g, beta, opts: KDAOptions, dt: torch.dtype):
    """The options' activations written out from their formulas (KDAOptions' docstring), in `dt`.

    Deliberately not `activations.activate`/`kda_gate`, which every fast path shares: the oracle is a
    second writing of the math, so a slip in the shared code shows up as a test failure.
    """
    q, k, g, beta = (x.to(dt) for x in (q, k, g, beta))
    if opts.use_qk_l2norm_in_kernel:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + opts.l2norm_eps) for x in (q, k))
    if opts.use_gate_in_kernel:
        H, K = g.shape[-2:]
        check_gate(H, K, opts.A_log, opts.dt_bias, opts.lower_bound, safe=opts.safe_gate)
        a = torch.ones(H, 1, dtype=dt) if opts.A_log is None else opts.A_log.to(dt).exp()[:, None]
        z = g if opts.dt_bias is None else g + opts.dt_bias.to(dt).reshape(H, K)
        g = -a * F.softplus(z) if opts.lower_bound is None else opts.lower_bound * torch.sigmoid(a * z)
    if opts.use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if opts.allow_neg_eigval else 1.0)
    return q, k, g, beta


def _recurrence(q, k, v, g, beta, S, chunk_size: int):
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; S [B, H, K, V]
    -> (o [B, T, H, V], S, the states entering each chunk of `chunk_size` tokens [B, NT, H, K, V])."""
    outs, entering = [], []
    # unbind, not x[:, t]: T slice reads (and slice writes into a preallocated o) would each cost a
    # full-size gradient in backward, O(T^2); one unbind and one stack keep it O(T)
    for t, (q_t, k_t, v_t, g_t, b_t) in enumerate(zip(*(x.unbind(1) for x in (q, k, v, g, beta)), strict=True)):
        if t % chunk_size == 0:
            entering.append(S)
        o_t, S = delta_update(q_t, k_t, v_t, g_t, b_t, S)
        outs.append(o_t)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    h = torch.stack(entering, dim=1) if entering else S.new_zeros(S.shape[0], 0, *S.shape[1:])
    return o, S, h


def kda_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    return_intermediate_states: bool = False,
    chunk_size: int = 16,
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reference KDA, one token at a time, in fp32 (fp64 when any input is fp64); `kda_chunk`'s signature.

    Args:
        q, k: `[B, T, H, K]`, used as given unless `use_qk_l2norm_in_kernel`.
        v: `[B, T, HV, V]`, HV a multiple of H (value head j reads q/k head j // (HV // H)).
        g: `[B, T, HV, K]` per-step natural-log decay, <= 0 (-inf resets the state); raw with
            `use_gate_in_kernel`.
        beta: `[B, T, HV]`, activated unless `use_beta_sigmoid_in_kernel`.
        scale: query scale, default `K ** -0.5`.
        initial_state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), default zeros.
        output_final_state: return the final state, same layout (else None).
        cu_seqlens: `[N + 1]` int64 offsets of packed sequences (B must be 1); empty sequences allowed.
        cu_seqlens_cpu: a host copy of cu_seqlens, read by the checks instead of it.
        return_intermediate_states: also return the states entering each chunk of `chunk_size` tokens.
        chunk_size: only sets where the intermediate states are taken.
        **options: `k3sys.kda.activations.KDAOptions` (fla's / FlashKDA's names).

    Returns:
        o `[B, T, HV, V]` in v's dtype, the final state in the compute dtype or None, and with
        `return_intermediate_states` the entering states `[B, NT, HV, K, V]` (`[1, sum of NT, ...]` varlen).
    """
    opts = kda_options(**options)
    cu_seqlens, cu_host = resolve_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.device)
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_host, state_v_first=opts.state_v_first)
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    q, k, g, beta = _activate(q, k, g, beta, opts, dt)
    check_log_decay(g)
    group = dims.HV // dims.H  # value head j reads q/k head j // group
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    v_first = (lambda S: S.transpose(-1, -2)) if opts.state_v_first else (lambda S: S)
    if initial_state is None:
        S0 = torch.zeros(dims.N, dims.HV, dims.K, dims.V, dtype=dt, device=q.device)
    else:
        S0 = v_first(initial_state).to(dt)
    xs = (q * (dims.K**-0.5 if scale is None else scale), k, v.to(dt), g, beta)
    if cu_seqlens is None:
        o, S, h = _recurrence(*xs, S0, chunk_size)
    else:
        pieces = [_recurrence(*(x[:, s:e] for x in xs), S0[n:n + 1], chunk_size)
                  for n, (_, s, e) in enumerate(sequence_spans(dims, cu_host))]
        o, S, h = (torch.cat(parts, dim=d) for parts, d in zip(zip(*pieces, strict=True), (1, 0, 1), strict=True))
    result = (o.to(v.dtype), v_first(S) if output_final_state else None)
    return (*result, v_first(h)) if return_intermediate_states else result
