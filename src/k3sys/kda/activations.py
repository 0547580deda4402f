"""The activations every KDA op can apply to its raw inputs (fla's `*_in_kernel` options), in one place.

fla's `chunk_kda` and FlashKDA take q, k, the gate and beta either already activated or raw, and then
L2-normalise q and k, apply the gate and sigmoid(beta) inside the op in fp32. Computing them outside
and handing them over in bf16 costs ~2e-3 relative error in the state; here they are computed in the
op's compute dtype (fp32, fp64 in oracle mode) from the inputs as given, so every backend (naive,
chunk, step, Triton) gets the same fp32 values. Autograd differentiates through them.

Grouped value attention (fla's convention): q, k have H heads; v, g, beta and the state have HV, a
multiple of H; value head j reads q/k head j // (HV // H) (`repeat_interleave`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from k3sys.kda.gate import check_gate, kda_gate
from k3sys.kda.validate import (
    MAX_HEAD_DIM,
    KDADims,
    check_inputs,
    check_log_decay,
    compute_dtype,
    resolve_cu_seqlens,
)


@dataclass(frozen=True)
class KDAOptions:
    """fla's `chunk_kda` options (FlashKDA's `torch_kda` takes the same names, plus `l2norm_eps`).

    use_qk_l2norm_in_kernel: q, k are raw; the op uses `x * rsqrt(sum(x^2) + l2norm_eps)`.
    use_gate_in_kernel: g is the raw gate input f; the op uses `kda_gate(f, A_log, dt_bias, lower_bound)`:
        `-exp(A_log) * softplus(f + dt_bias)` (A_log `[HV]` required) when `lower_bound` is None, else
        `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))` (`sigmoid(f + dt_bias)` with A_log None).
        dt_bias `[HV * K]` (fla) or `[HV, K]` (FlashKDA), optional.
    safe_gate: fla's flag for the bounded gate: requires `lower_bound` in [-5, 0) (without it any
        negative lower bound is accepted).
    use_beta_sigmoid_in_kernel: beta is a logit; the op uses sigmoid(beta), or 2 sigmoid(beta) with
        `allow_neg_eigval` (beta in (0, 2): the transition I - beta k k^T may have negative eigenvalues).
    state_v_first: initial and final (and intermediate) states are `[..., V, K]` instead of `[..., K, V]`.
    """

    use_qk_l2norm_in_kernel: bool = False
    l2norm_eps: float = 1e-6
    use_gate_in_kernel: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    safe_gate: bool = False
    lower_bound: float | None = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    state_v_first: bool = False

    @property
    def activates(self) -> bool:
        """Whether the op computes any activation itself."""
        return self.use_qk_l2norm_in_kernel or self.use_gate_in_kernel or self.use_beta_sigmoid_in_kernel


OPTION_NAMES = tuple(f.name for f in fields(KDAOptions))
_DEFAULTS = KDAOptions()
# Names other APIs use for the same option: fla's deprecated (and FlashKDA's README's) state flag.
ALIASES = {"transpose_state_layout": "state_v_first"}
# fla arguments that change how, not what, it computes; accepted and ignored here.
IGNORED = ("disable_recompute",)


def kda_options(**kwargs) -> KDAOptions:
    """Options from fla/FlashKDA keyword arguments; TypeError on a name neither uses, ValueError on bad values."""
    if not kwargs:  # the plain call, once per decoded token: the defaults are valid and frozen
        return _DEFAULTS
    for alias, name in ALIASES.items():
        if alias in kwargs:
            if kwargs.get(name):
                raise ValueError(f"pass either {name} or its alias {alias}, not both")
            kwargs[name] = kwargs.pop(alias)
    for name in IGNORED:
        kwargs.pop(name, None)
    unknown = sorted(set(kwargs) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}; KDA ops take {list(OPTION_NAMES)} "
                        f"(and {list(ALIASES)}, {list(IGNORED)})")
    opts = KDAOptions(**kwargs)
    if opts.allow_neg_eigval and not opts.use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True scales sigmoid(beta) to (0, 2), so it needs "
                         "use_beta_sigmoid_in_kernel=True (beta given as logits)")
    if opts.use_gate_in_kernel and opts.A_log is None and opts.lower_bound is None:
        raise ValueError("use_gate_in_kernel=True needs A_log (softplus gate) or lower_bound (bounded gate)")
    if opts.safe_gate and opts.use_gate_in_kernel and opts.lower_bound is None:
        raise ValueError("safe_gate=True needs lower_bound in [-5, 0)")
    if not opts.use_gate_in_kernel and (opts.A_log is not None or opts.dt_bias is not None):
        raise ValueError("A_log / dt_bias are only used with use_gate_in_kernel=True")
    return opts


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(sum(x^2, -1) + eps)`, fla's and FlashKDA's form (eps inside the root).

    The sum of squares as a norm squared: one fused read of x instead of a squared copy (2.6x faster here).
    """
    return x * torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + eps)


def expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """`[B, T, H, K]` -> `[B, T, HV, K]`, value head j reading head j // (HV // H) (no copy when HV == H)."""
    group = num_v_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, without the call when x has it: a no-op `.to` still costs ~1.6 us here, a
    fifth of a one-sequence decode step (`kda_step` casts seven tensors)."""
    return x if x.dtype == dtype else x.to(dtype)


def activate(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, opts: KDAOptions, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k `[B, T, H, K]`, g `[B, T, HV, K]`, beta `[B, T, HV]` as given -> the same, activated, in `dtype`.

    q and k keep H heads (see `expand_heads`); inputs an option does not touch are only cast.
    """
    q, k, beta = cast(q, dtype), cast(k, dtype), cast(beta, dtype)
    if opts.use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q, opts.l2norm_eps), l2_normalize(k, opts.l2norm_eps)
    if opts.use_gate_in_kernel:
        g = kda_gate(cast(g, dtype), opts.A_log, opts.dt_bias, opts.lower_bound, safe=opts.safe_gate)
    else:
        g = cast(g, dtype)
    if opts.use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if opts.allow_neg_eigval else 1.0)
    return q, k, g, beta


def state_in(state: torch.Tensor | None, opts: KDAOptions) -> torch.Tensor | None:
    """A caller's state in the ops' `[..., K, V]` layout (a view)."""
    return state.transpose(-1, -2) if state is not None and opts.state_v_first else state


state_out = state_in  # the layout change is its own inverse


@dataclass(frozen=True)
class Prepared:
    """A sequence op's inputs checked and activated: q, k `[B, T, HV, K]` (expanded to the value heads,
    unscaled), v `[B, T, HV, V]`, g `[B, T, HV, K]`, beta `[B, T, HV]` and S0 `[N, HV, K, V]` (or None) in
    the compute dtype; the resolved scale and cu_seqlens (on q's device). With `prepare(raw=True)` q, k, g,
    beta are the inputs as given (cast only) and q, k keep their H heads."""

    dims: KDADims
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    S0: torch.Tensor | None
    scale: float
    cu_seqlens: torch.Tensor | None


def prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float | None,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
    opts: KDAOptions, max_head_dim: int = MAX_HEAD_DIM, dtype: torch.dtype | None = None, raw: bool = False,
) -> Prepared:
    """Check shapes, apply the options' activations, check g's range; shared by every sequence op.

    dtype: the compute dtype, default fp32 (fp64 when any input is fp64).
    raw: only cast q, k, g, beta, leaving the activations, g's check and the head expansion (q, k keep
        H heads) to a kernel that does them itself (`chunk_fused`).
    """
    cu_seqlens, cu_host = resolve_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.device)
    dims = check_inputs(q, k, v, g, beta, initial_state, cu_host, max_head_dim, opts.state_v_first)
    dt = dtype or compute_dtype(q, k, v, g, beta, initial_state)
    S0 = state_in(initial_state, opts)
    S0 = None if S0 is None else S0.to(dt)
    scale = dims.K**-0.5 if scale is None else scale
    if raw:  # the same checks, minus the kernel's: it counts the NaN gates it computes
        if opts.use_gate_in_kernel:
            check_gate(dims.HV, dims.K, opts.A_log, opts.dt_bias, opts.lower_bound, opts.safe_gate)
        else:
            check_log_decay(g)
        return Prepared(dims, cast(q, dt), cast(k, dt), cast(v, dt), cast(g, dt), cast(beta, dt), S0, scale, cu_seqlens)
    q, k, g, beta = activate(q, k, g, beta, opts, dt)
    check_log_decay(g)
    return Prepared(dims, expand_heads(q, dims.HV), expand_heads(k, dims.HV), v.to(dt), g, beta, S0, scale,
                    cu_seqlens)
