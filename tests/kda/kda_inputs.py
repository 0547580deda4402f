"""Random KDA inputs for the tests: L2-normalised q, k; g from the real gate; beta in (0, 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3sys.kda import kda_gate

GATES = ("safe", "plain", "huge")


def make_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.float64, gate: str = "safe",
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, g `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]` in `dtype`.

    gate: "safe" (lower bound -5), "plain" (unbounded, moderate), or "huge": the plain gate plus, at about
    one token in 20 per head, a step between -50 and -5000, so some 16-token blocks span far beyond exp's
    range in fp32 and fp64 (the pairwise path runs) while others do not.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
    v, f = randn(B, T, H, V), randn(B, T, H, K)
    A_log, dt_bias = 0.5 * randn(H), 0.5 * randn(H, K)
    if gate == "safe":
        g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    elif gate == "plain":
        g = kda_gate(f, A_log, dt_bias)
    elif gate == "huge":
        hit = torch.rand(B, T, H, 1, generator=gen, dtype=torch.float64) < 0.05
        spike = torch.empty(B, T, H, 1, dtype=torch.float64).uniform_(50, 5000, generator=gen)
        g = kda_gate(f, A_log, dt_bias) - hit * spike
    else:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


# fla's in-kernel option sets, each tested against the fp64 oracle given the same raw inputs.
OPTION_SETS = {
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "softplus_gate": dict(use_gate_in_kernel=True, with_A_log=True),
    "safe_gate": dict(use_gate_in_kernel=True, with_A_log=True, safe_gate=True, lower_bound=-5.0),
    "bounded_gate_no_A_log": dict(use_gate_in_kernel=True, lower_bound=-3.0),
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg_eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "all_v_first": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, with_A_log=True, safe_gate=True,
                        lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, state_v_first=True),
}


def make_raw_inputs(B: int, T: int, H: int, HV: int, K: int, V: int, option_set: str,
                    dtype: torch.dtype = torch.float64, seed: int = 0,
                    flat_dt_bias: bool = True) -> tuple[list[torch.Tensor], dict]:
    """Inputs as a caller of fla's `chunk_kda` with `option_set` hands them over, and the keyword options.

    Returns ([q, k, v, g, beta] in `dtype`, options): q, k `[B, T, H, K]` raw (not normalised) when the set
    normalises them, v `[B, T, HV, V]`, g `[B, T, HV, K]` the raw gate input when the set gates in the
    kernel (else an activated safe gate), beta `[B, T, HV]` logits when the set applies the sigmoid;
    options holds A_log `[HV]` / dt_bias `[HV * K]` (or `[HV, K]`) fp32 tensors where the set uses them.
    """
    opts = dict(OPTION_SETS[option_set])
    with_A_log = opts.pop("with_A_log", False)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if not opts.get("use_qk_l2norm_in_kernel"):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v, f = randn(B, T, HV, V), randn(B, T, HV, K)
    if opts.get("use_gate_in_kernel"):
        g = f
        opts["dt_bias"] = (0.5 * randn(HV * K) if flat_dt_bias else 0.5 * randn(HV, K)).float()
        if with_A_log:  # rates around e^-1: the softplus gate then stays inside the safe range the Triton kernels need
            opts["A_log"] = (0.5 * randn(HV) - 1.0).float()
    else:
        g = kda_gate(f, 0.5 * randn(HV), 0.5 * randn(HV, K), lower_bound=-5.0)
    beta = 2 * randn(B, T, HV) if opts.get("use_beta_sigmoid_in_kernel") else torch.rand(
        B, T, HV, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta)], opts


def option_grads(fn, xs: list[torch.Tensor], opts: dict, S0: torch.Tensor, cu: torch.Tensor | None, seed: int = 7,
                 **kw):
    """(o, final state, gradients of q, k, v, g, beta, initial_state and the option tensors A_log, dt_bias)."""
    leaves = [x.clone().requires_grad_() for x in (*xs, S0)]
    tensors = {name: opts[name].to(S0.dtype).requires_grad_() for name in ("A_log", "dt_bias") if name in opts}
    o, S = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, **{**opts, **tensors}, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum() + (
        S.double() * torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.device)).sum()
    return o, S, dict(zip(("q", "k", "v", "g", "beta", "initial_state", *tensors),
                          torch.autograd.grad(loss, [*leaves, *tensors.values()]), strict=True))
