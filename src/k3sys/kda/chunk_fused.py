"""The fused CPU forward of `kda_chunk` (`chunk_fwd.cpp`): both phases in one C++ pass per (sequence, head).

Why: the torch path's phase 1 is ~10 elementwise passes and small batched matmuls over `[M, H, 16, K]`
tensors plus token <-> slot gathers, and ran at ~10 GFLOP/s; its phase 2 at ~45% of the matmul peak.
The kernel keeps one head's chunk workspace (~100 KB at K = V = 128) and its state (64 KB, column-blocked)
in cache for a whole sequence, reads the token-major inputs directly and writes o in place
(docs/kda.md, "The fused CPU forward").

It runs only when nothing needs its intermediates: CPU fp32 (bf16/fp16 inputs are cast), chunk_size 16,
no autograd (no input or gate parameter requires grad, or grad mode off), no intermediate states.
Everything else (and a machine where it cannot be built, or `K3SYS_KDA_FUSED=0`) takes the torch path,
which stays the reference and autograd's. The kernel also applies fla's in-op activations (l2 norms,
the bounded gate, sigmoid(beta)) to the rows it gathers, so they cost no extra pass over [T, H, K]
tensors; only the softplus gate (unbounded: no vector log here) is applied in torch first.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from k3sys.kda.activations import KDAOptions, Prepared, activate
from k3sys.kda.native import load_library
from k3sys.kda.validate import NaNError, check_log_decay, compute_dtype

SOURCE = Path(__file__).with_name("chunk_fwd.cpp")
CHUNK_SIZE = 16  # the kernel's C
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = ([_PTR] * 8 + [_I64] * 5 + [ctypes.c_double, ctypes.c_int, ctypes.c_double, ctypes.c_int, _PTR, _PTR]
              + [ctypes.c_double] * 2, _I64)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel library, or None (with one warning) where it cannot be built or loaded."""
    return load_library(SOURCE, "the fused KDA chunk forward", "kda_chunk runs its torch path",
                        {"kda_chunk_fwd_f32": _SIGNATURE})


def kernel_activates(opts: KDAOptions) -> bool:
    """Whether the kernel computes every activation `opts` asks for (all but the softplus gate)."""
    return not (opts.use_gate_in_kernel and opts.lower_bound is None)


def runs_fused(tensors: tuple[torch.Tensor | None, ...], opts: KDAOptions, chunk_size: int, keep_states: bool) -> bool:
    """Whether `kda_chunk` on `tensors` (q, k, v, g, beta, initial_state as given) takes the kernel."""
    ts = [t for t in (*tensors, opts.A_log, opts.dt_bias) if t is not None]
    if (keep_states or chunk_size != CHUNK_SIZE or any(t.device.type != "cpu" for t in ts)
            or compute_dtype(*tensors) != torch.float32):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return _library() is not None


def fused_forward(p: Prepared, S0: torch.Tensor, opts: KDAOptions | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_chunk`'s forward where `runs_fused`: (o `[B, T, HV, V]`, final states `[N, HV, K, V]`) fp32.

    p: prepared inputs, raw (`prepare(raw=True)`) when `opts` is given: the kernel applies its activations.
    S0 `[N, HV, K, V]` is not modified.
    """
    B, T, HV, K, V = p.dims.B, p.dims.T, p.dims.HV, p.dims.K, p.dims.V
    q, k, v, g, beta = (t.contiguous() for t in (p.q, p.k, p.v, p.g, p.beta))
    act = opts or KDAOptions()
    gate = act.use_gate_in_kernel
    A_log, dt_bias = ((None if x is None or not gate else x.to(torch.float32).contiguous().view(-1))
                      for x in (act.A_log, act.dt_bias))
    if p.cu_seqlens is None:
        cu = torch.arange(B + 1, dtype=torch.int64) * T
    else:
        cu = p.cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    S = S0.contiguous().clone()  # updated in place by the kernel
    o = torch.empty(B, T, HV, V, dtype=torch.float32)
    beta_scale = (2.0 if act.allow_neg_eigval else 1.0) if act.use_beta_sigmoid_in_kernel else 0.0
    rc = _library().kda_chunk_fwd_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), S.data_ptr(), o.data_ptr(),
        cu.data_ptr(), cu.numel() - 1, q.shape[2], HV, K, V, p.scale, int(act.use_qk_l2norm_in_kernel),
        act.l2norm_eps, int(gate), None if A_log is None else A_log.data_ptr(),
        None if dt_bias is None else dt_bias.data_ptr(), act.lower_bound or 0.0, beta_scale)
    if rc < 0:
        raise MemoryError(f"the fused KDA chunk forward could not allocate its workspace (K={K}, V={V})")
    if rc:  # NaN gate values: the torch activation names them as every other path does
        check_log_decay(activate(p.q, p.k, p.g, p.beta, act, torch.float32)[2])
        raise NaNError("g must not be NaN")
    return o, S
