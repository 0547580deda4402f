"""The fused CPU decode step (`fused_step.cpp`): compiled with g++ on first use, cached, called via ctypes.

Why C++: a decode step is memory-bound, and its floor is one read and one write of the state. The
torch formula reads it four times and writes it twice (S * exp(g), two einsums, the rank-1 update)
and allocates a state-sized temporary for each: 10-30x that floor here (bench/kda_decode.py). Torch ops
in place (one bmm for both reductions, `mul_`, `baddbmm_`) still read it three times and write it twice:
3.0-3.8 ms at N = 64 (H = 4, K = V = 128, one thread) where the kernel takes 0.9-1.0 ms and a copy_ of
the state 1.2-1.4 ms (an update in place moves less than a copy into another buffer). The kernel reads each block
of the state once for both reductions, then updates it from L1 and writes it once, in place if the
caller allows. Why ctypes and not `torch.utils.cpp_extension`: the kernel needs raw pointers only, so
it builds in about a second without torch's headers or ninja, and a call costs ~1 us.

Built and cached by `k3sys.kda.native` (no compiler, a failed build or `K3SYS_KDA_FUSED=0` leave
`available()` False, and the step falls back to the torch formula).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from k3sys.kda.native import load_library

SOURCE = Path(__file__).with_name("fused_step.cpp")
MAX_K = 512  # the kernel's per-head buffers (fused_step.cpp's MAX_K)
DTYPES = {torch.float32: "kda_step_f32", torch.float64: "kda_step_f64"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR] * 8 + [_I64] * 5 + [ctypes.c_double, ctypes.c_int]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel library, or None (with one warning) where it cannot be built or loaded."""
    return load_library(SOURCE, "the fused KDA step", "kda_step runs the torch formula",
                        {name: (_ARGTYPES, _I64) for name in DTYPES.values()})


def available() -> bool:
    """Whether the fused kernel is built (building it on the first call)."""
    return _library() is not None


def fused_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, out: torch.Tensor, scale: float, v_first: bool) -> torch.Tensor | None:
    """One decode step on CPU tensors of one float dtype; requires `available()`.

    q, k `[N, H, K]` (activated, unscaled), v `[N, HV, V]`, g `[N, HV, K]` (log-decay), beta `[N, HV]`;
    state and out `[N, HV, K, V]` (`[N, HV, V, K]` with `v_first`), contiguous; out may be state itself
    (in place). Returns o `[N, HV, V]`, or None, with nothing written, when some g is positive or NaN.
    """
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    N, H, K = q.shape
    HV, V = v.shape[1:]
    o = torch.empty(N, HV, V, dtype=q.dtype)
    bad = getattr(_library(), DTYPES[q.dtype])(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(), out.data_ptr(),
        o.data_ptr(), N, H, HV, K, V, scale, int(v_first))
    return None if bad else o
