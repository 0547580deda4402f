"""The fused CPU forward of `kda_chunk` (`chunk_fwd.cpp`): both phases in one C++ pass per (sequence, head).

Why: the torch path's phase 1 is ~10 elementwise passes and small batched matmuls over `[M, H, 16, K]`
tensors plus token <-> slot gathers, and ran at ~10 GFLOP/s; its phase 2 at ~45% of the matmul peak.
The kernel keeps one head's chunk workspace (~100 KB at K = V = 128) and its state (64 KB, column-blocked)
in cache for a whole sequence, reads the token-major inputs directly and writes o in place
(docs/kda.md, "The fused CPU forward").

It runs only when nothing needs its intermediates: CPU fp32, chunk_size 16, no autograd (no input
requires grad, or grad mode off), no intermediate states. Everything else (and a machine where it
cannot be built, or `K3SYS_KDA_FUSED=0`) takes the torch path, which stays the reference and autograd's.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from k3sys.kda.activations import Prepared
from k3sys.kda.native import load_library

SOURCE = Path(__file__).with_name("chunk_fwd.cpp")
CHUNK_SIZE = 16  # the kernel's C
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = ([_PTR] * 8 + [_I64] * 4 + [ctypes.c_double], _I64)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel library, or None (with one warning) where it cannot be built or loaded."""
    return load_library(SOURCE, "the fused KDA chunk forward", "kda_chunk runs its torch path",
                        {"kda_chunk_fwd_f32": _SIGNATURE})


def fused_forward(p: Prepared, S0: torch.Tensor, chunk_size: int,
                  keep_states: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`kda_chunk`'s forward on prepared inputs: (o `[B, T, HV, V]`, final states `[N, HV, K, V]`) fp32, or
    None when the call needs the torch path (see the module docstring). S0 `[N, HV, K, V]` is not modified."""
    tensors = (p.q, p.k, p.v, p.g, p.beta, S0)
    if (keep_states or chunk_size != CHUNK_SIZE or p.v.device.type != "cpu"
            or any(t.dtype != torch.float32 for t in tensors)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    lib = _library()
    if lib is None:
        return None
    B, T, HV, K, V = p.dims.B, p.dims.T, p.dims.HV, p.dims.K, p.dims.V
    q, k, v, g, beta = (t.contiguous() for t in tensors[:5])
    if p.cu_seqlens is None:
        cu = torch.arange(B + 1, dtype=torch.int64) * T
    else:
        cu = p.cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    S = S0.contiguous().clone()  # updated in place by the kernel
    o = torch.empty(B, T, HV, V, dtype=torch.float32)
    if lib.kda_chunk_fwd_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), S.data_ptr(),
                             o.data_ptr(), cu.data_ptr(), cu.numel() - 1, HV, K, V, p.scale):
        raise MemoryError(f"the fused KDA chunk forward could not allocate its workspace (K={K}, V={V})")
    return o, S
