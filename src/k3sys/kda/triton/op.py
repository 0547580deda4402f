"""KDA on Triton: launchers for the two phases and the autograd function that wires their gradients.

Forward: phase 1 (intra_fwd_kernel) writes W, Q', kg, U, Ou, G_C for every chunk at once; phase 2
(inter_fwd_kernel) walks the chunks. Backward recomputes phase 1 and the per-chunk states from the
inputs (nothing but the inputs is saved), runs the reverse recurrence (inter_bwd_kernel), then the
token-parallel gradient kernel (intra_bwd_kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from k3sys.kda.activations import KDAOptions, kda_options, prepare, state_out
from k3sys.kda.gate import kda_gate
from k3sys.kda.triton.chunks import CHUNK, Chunks, chunk_maps
from k3sys.kda.triton.fused import fused_fwd_kernel
from k3sys.kda.triton.inter import inter_bwd_kernel, inter_fwd_kernel
from k3sys.kda.triton.interpreter import patch_bf16
from k3sys.kda.triton.intra import intra_fwd_kernel
from k3sys.kda.triton.intra_bwd import intra_bwd_kernel
from k3sys.kda.triton.tuning import TunedKernel

MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SAFE_GATE_MIN = -5.0  # the kernels' numerics contract, see intra.py

try:
    from triton.runtime.interpreter import InterpretedFunction

    INTERPRETED = isinstance(intra_fwd_kernel, InterpretedFunction)
except ImportError:  # pragma: no cover - layout of older triton
    INTERPRETED = False
# On CPU the kernels run in Triton's interpreter, whose bf16 arithmetic needs a patch to match a GPU's.
INTERPRETER_BF16 = INTERPRETED and patch_bf16()


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products; 16-bit inputs run their fp32 phase-1 products in tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _state_tile(K: int, V: int, programs: int, device: torch.device) -> int:
    """Untuned V-tile width of the recurrent kernels: as wide as registers allow, narrowed until the grid fills the GPU.

    The recurrence is serial over chunks, so (V-tiles x sequences x heads) programs are all the
    parallelism there is; B=1, H=32, V=128 at width 64 would leave half of an H200's 132 SMs idle.
    """
    BV = min(64 if K <= 128 else 32, _pow2(V))
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        while BV > 16 and triton.cdiv(V, BV) * programs < sms:
            BV //= 2
    return BV


def _warps(BK: int) -> int:
    # Register-bound at K = 256 (the fp32 state tile and phase 1's [16, K] fp32 factors).
    return 4 if BK <= 128 else 8


# The gradient kernel holds three fp32 [16, K] accumulators and two [K, BV] state tiles at once; with
# 8 warps, BV = 32 is the widest tile that compiles for sm_90 without spilling at K = 128. Not tuned.
GRAD_WARPS, GRAD_BV = 8, 32

# Search spaces (tests/kda/hopper_compile.py shows what each point costs in registers); the recurrent
# kernels tune the V-tile, which sets how many programs share the GPU.
RECURRENT_SPACE = dict(BV=(16, 32, 64), num_warps=(4, 8), num_stages=(2,))
INTRA_FWD = TunedKernel(intra_fwd_kernel, INTERPRETED, num_warps=(2, 4, 8))
INTER_FWD = TunedKernel(inter_fwd_kernel, INTERPRETED, **RECURRENT_SPACE)
INTER_BWD = TunedKernel(inter_bwd_kernel, INTERPRETED, **RECURRENT_SPACE)
FUSED_FWD = TunedKernel(fused_fwd_kernel, INTERPRETED, **RECURRENT_SPACE)


def _recurrent_defaults(K: int, V: int, programs: int, device: torch.device) -> dict:
    return dict(BV=_state_tile(K, V, programs, device), num_warps=_warps(_pow2(K)), num_stages=2)


@dataclass(frozen=True)
class Workspace:
    """Phase 1's output (see intra.py): w, qp, kg `[*, H, K]` and u, ou `[*, H, V]` in the inputs' dtype,
    gc `[NC, H, K]` in fp32."""

    w: torch.Tensor
    qp: torch.Tensor
    kg: torch.Tensor
    u: torch.Tensor
    ou: torch.Tensor
    gc: torch.Tensor


def intra_fwd(q, k, v, g, beta, scale: float, chunks: Chunks) -> Workspace:
    """Phase 1 for every chunk of every head at once."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    ws = Workspace(
        w=torch.empty_like(k), qp=torch.empty_like(q), kg=torch.empty_like(k), u=torch.empty_like(v),
        ou=torch.empty_like(v), gc=torch.empty(chunks.num_chunks, H, K, device=q.device, dtype=torch.float32),
    )
    BK = _pow2(K)
    INTRA_FWD[(chunks.num_chunks, H)](
        q, k, v, g, beta, ws.w, ws.qp, ws.kg, ws.u, ws.ou, ws.gc,
        chunks.cu_seqlens, chunks.indices, scale,
        H=H, K=K, V=V, C=CHUNK, BK=BK, BV=_pow2(V), PREC=_precision(q.dtype), defaults=dict(num_warps=_warps(BK)),
    )
    return ws


def inter_fwd(ws: Workspace, h0: torch.Tensor | None, chunks: Chunks, *, store_o: bool, store_ht: bool,
              store_states: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Phase 2 forward: (o `[*, H, V]`, final state `[N, H, K, V]` fp32, entering states `[NC, H, K, V]`)."""
    H, K, V = ws.w.shape[2], ws.w.shape[3], ws.u.shape[3]
    N = chunks.num_seqs
    o = torch.empty_like(ws.u) if store_o else None
    ht = ws.w.new_empty(N, H, K, V, dtype=torch.float32) if store_ht else None
    states = ws.w.new_empty(chunks.num_chunks, H, K, V) if store_states else None
    INTER_FWD[lambda meta: (triton.cdiv(V, meta["BV"]), N * H)](
        ws.w, ws.qp, ws.kg, ws.u, ws.ou, ws.gc, h0, o, ht, states,
        chunks.cu_seqlens, chunks.offsets,
        H=H, K=K, V=V, C=CHUNK, BK=_pow2(K), PREC=_precision(ws.w.dtype),
        USE_H0=h0 is not None, STORE_O=store_o, STORE_HT=store_ht, STORE_STATES=store_states,
        defaults=_recurrent_defaults(K, V, N * H, ws.w.device),
    )
    return o, ht, states


def inter_bwd(ws: Workspace, do: torch.Tensor, dht: torch.Tensor | None, h0: torch.Tensor | None,
              chunks: Chunks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Phase 2 backward: (dstates `[NC, H, K, V]` for the states leaving each chunk, dV' `[*, H, V]`, dh0)."""
    H, K, V = ws.w.shape[2], ws.w.shape[3], ws.u.shape[3]
    N = chunks.num_seqs
    dstates = ws.w.new_empty(chunks.num_chunks, H, K, V)
    dvn = torch.empty_like(ws.u, dtype=torch.float32)  # fp32: dv and dbeta are read off it directly
    dh0 = torch.empty_like(h0) if h0 is not None else None
    INTER_BWD[lambda meta: (triton.cdiv(V, meta["BV"]), N * H)](
        ws.w, ws.qp, ws.kg, ws.gc, do, dht, dh0, dstates, dvn,
        chunks.cu_seqlens, chunks.offsets,
        H=H, K=K, V=V, C=CHUNK, BK=_pow2(K), PREC=_precision(ws.w.dtype),
        USE_DHT=dht is not None, STORE_DH0=h0 is not None,
        defaults=_recurrent_defaults(K, V, N * H, ws.w.device),
    )
    return dstates, dvn, dh0


def intra_bwd(q, k, v, g, beta, scale: float, states, dstates, do, dvn, chunks: Chunks):
    """Token-parallel gradients: (dq, dk, dv, dg, dbeta), each like its input."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    dq, dk, dv, dg, dbeta = (torch.empty_like(x) for x in (q, k, v, g, beta))
    BK = _pow2(K)
    intra_bwd_kernel[(chunks.num_chunks, H)](
        q, k, v, g, beta, states, dstates, do, dvn, dq, dk, dv, dg, dbeta,
        chunks.cu_seqlens, chunks.indices, scale,
        H=H, K=K, V=V, C=CHUNK, BK=BK, BV=min(GRAD_BV, _pow2(V)), PREC=_precision(q.dtype), num_warps=GRAD_WARPS,
    )
    return dq, dk, dv, dg, dbeta


def _kernel_limits(q, k, v, g, beta, initial_state=None) -> str | None:
    """What the kernels cannot run (dtypes, head dims, device), found without reading any data."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is not None and x.dtype not in DTYPES:
            return f"it takes bf16/fp16/fp32 inputs, got {name} of {x.dtype}"
    K, V = q.shape[-1], v.shape[-1]
    if max(K, V) > MAX_HEAD_DIM:
        return f"it supports K, V <= {MAX_HEAD_DIM}, got K={K}, V={V}"
    if q.device.type != "cuda" and not INTERPRETED:
        return (f"it needs CUDA tensors, got {q.device.type}; on CPU it runs only in Triton's interpreter "
                "(set TRITON_INTERPRET=1 before triton is first imported)")
    if INTERPRETED and v.dtype == torch.bfloat16 and not INTERPRETER_BF16:
        return "this Triton version's interpreter cannot run bf16; use fp16/fp32 on CPU"
    return None


def triton_unsupported(q, k, v, g, beta, chunk_size: int = CHUNK, initial_state=None,
                       opts: KDAOptions | None = None) -> str | None:
    """Why the Triton backend cannot run this call, or None when it can.

    Besides the kernel limits, checks the safe-gate contract (min g >= -5 after the options' gate), which
    reads g once and syncs with the device unless the in-kernel bounded gate guarantees it:
    `kda_chunk` uses this to choose (backend="auto") or refuse (backend="triton").
    """
    opts = opts or KDAOptions()
    if chunk_size != CHUNK:
        return f"its chunk size is {CHUNK}, got chunk_size={chunk_size}"
    why = _kernel_limits(q, k, v, g, beta, initial_state)
    if why is not None or g.numel() == 0:
        return why
    if opts.use_gate_in_kernel and opts.lower_bound is not None and opts.lower_bound >= SAFE_GATE_MIN:
        return None  # lower_bound * sigmoid(.) stays in [lower_bound, 0]
    if opts.use_gate_in_kernel:
        g = kda_gate(g, opts.A_log, opts.dt_bias, opts.lower_bound, safe=False)
    if (g_min := g.min().item()) < SAFE_GATE_MIN:
        return (f"it needs the safe gate, every g >= {SAFE_GATE_MIN} (16-step decays inside fp32's exp range), "
                f"got min g = {g_min:.4g}; use backend='torch'")
    return None


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, opts: KDAOptions):
    """Checked, activated, contiguous kernel inputs (`Prepared`) and the chunk maps.

    q, k, v share one dot dtype: v's, or fp32 when the op computes activations, so that their fp32 values
    (the reason to compute them here) are not rounded back to 16 bits; g, beta and the state are fp32.
    """
    if (why := _kernel_limits(q, k, v, g, beta, initial_state)) is not None:
        raise ValueError(f"backend='triton' cannot run this call: {why}")
    p = prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, opts, MAX_HEAD_DIM, torch.float32)
    dot = torch.float32 if opts.activates else v.dtype
    p = replace(p, q=p.q.to(dot).contiguous(), k=p.k.to(dot).contiguous(), v=p.v.to(dot).contiguous(),
                g=p.g.contiguous(), beta=p.beta.contiguous(), S0=None if p.S0 is None else p.S0.contiguous())
    return p, chunk_maps(p.dims.B, p.dims.T, p.cu_seqlens, q.device)


class KDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, output_final_state, chunks, keep_states):
        ws = intra_fwd(q, k, v, g, beta, scale, chunks)
        o, ht, states = inter_fwd(ws, h0, chunks, store_o=True, store_ht=output_final_state, store_states=keep_states)
        ctx.save_for_backward(q, k, v, g, beta, h0)
        ctx.scale, ctx.chunks = scale, chunks
        if keep_states:
            ctx.mark_non_differentiable(states)
        return o, ht, states

    @staticmethod
    def backward(ctx, do, dht, _):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        scale, chunks = ctx.scale, ctx.chunks
        ws = intra_fwd(q, k, v, g, beta, scale, chunks)
        _, _, states = inter_fwd(ws, h0, chunks, store_o=False, store_ht=False, store_states=True)
        dstates, dvn, dh0 = inter_bwd(ws, do.contiguous(), dht.contiguous() if dht is not None else None, h0, chunks)
        del ws
        dq, dk, dv, dg, dbeta = intra_bwd(q, k, v, g, beta, scale, states, dstates, do.contiguous(), dvn, chunks)
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None


def kda_triton(
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
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Chunked KDA on Triton kernels, differentiable in every tensor input; `kda_chunk`'s signature.

    Contract: the safe gate, g >= -5 per step after the options' gate (see `k3sys.kda.triton.intra`);
    `kda_chunk(..., backend="triton")` checks it, this op does not.

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; bf16, fp16 or fp32 (q, k are cast to v's dtype, all three
            to fp32 when the op computes activations), K, V <= 256.
        g: `[B, T, HV, K]` per-step log-decay in [-5, 0], or the raw gate with `use_gate_in_kernel`.
        beta: `[B, T, HV]`.
        scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, return_intermediate_states,
            **options: as in `kda_chunk`.

    Returns:
        o `[B, T, HV, V]` in v's dtype, the final state (fp32) or None, and with `return_intermediate_states`
        the states entering each chunk (in the dot dtype, as the kernels keep them).
    """
    opts = kda_options(**options)
    p, chunks = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, opts)
    d = p.dims
    if d.B * d.T == 0:  # no tokens: every state passes through
        S = p.S0 if p.S0 is not None else p.v.new_zeros(d.N, d.HV, d.K, d.V, dtype=torch.float32)
        o, ht, h = v.new_zeros(v.shape), S, S.new_zeros(d.B, 0, d.HV, d.K, d.V)
    else:
        o, ht, h = KDAFunction.apply(p.q, p.k, p.v, p.g, p.beta, p.scale, p.S0, output_final_state, chunks,
                                     return_intermediate_states)
        if h is not None:
            h = h.view(d.B, -1, *h.shape[1:]) if p.cu_seqlens is None else h.unsqueeze(0)
    result = (o.to(v.dtype), state_out(ht, opts) if output_final_state else None)
    return (*result, state_out(h, opts)) if return_intermediate_states else result


@torch.no_grad()
def kda_triton_fused(
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
    """`kda_triton`'s forward with both phases in one kernel (no autograd, no options): the split's benchmark
    baseline."""
    p, chunks = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, None, KDAOptions())
    q, k, v, g, beta, scale, h0 = p.q, p.k, p.v, p.g, p.beta, p.scale, p.S0
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = chunks.num_seqs
    o = torch.empty_like(v)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    FUSED_FWD[lambda meta: (triton.cdiv(V, meta["BV"]), N * H)](
        q, k, v, g, beta, h0, o, ht, chunks.cu_seqlens, scale,
        H=H, K=K, V=V, C=CHUNK, BK=_pow2(K), PREC=_precision(q.dtype),
        USE_H0=h0 is not None, STORE_HT=output_final_state,
        defaults=_recurrent_defaults(K, V, N * H, q.device),
    )
    return o, ht
