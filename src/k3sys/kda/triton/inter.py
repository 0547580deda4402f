"""Phase 2, recurrent: one program per (V-tile, sequence x head) walks its chunks with the state on chip.

Per chunk, from phase 1's workspace and the fp32 state S `[K, BV]` entering it:
    V' = U - W S;   O = Q' S + Ou;   S <- Diag(e^G_C) S + kg^T V'
and backwards, with dS the gradient of the state leaving the chunk:
    dV' = kg dS;   dS <- Diag(e^G_C) dS + Q'^T dO - W^T dV'
The serial chain per chunk is two products (W S, then kg^T V'; backwards kg dS, then W^T dV'); Q' S and
Q'^T dO hang off it. Dot operands are in the workspace dtype (bf16/fp16 tensor-core MMAs, fp32 with IEEE
products for fp32 inputs) and accumulate in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3sys.kda.triton.intra import load_state, load_tokens, sequence_of, store_state, store_tokens


@triton.jit
def inter_step(S, w, qp, kg, u, ou, G_C, PREC: tl.constexpr):
    """One chunk of the recurrence: fp32 state `[BK, BV]` in, (O `[C, BV]`, state out) in fp32.

    w, qp, kg `[C, BK]` come in the dot operand dtype; u, ou `[C, BV]` and G_C `[BK]` in fp32.
    """
    Sd = S.to(w.dtype)
    vn = u - tl.dot(w, Sd, input_precision=PREC)
    o = tl.dot(qp, Sd, input_precision=PREC) + ou
    S = S * tl.exp(G_C)[:, None] + tl.dot(tl.trans(kg), vn.to(w.dtype), input_precision=PREC)
    return o, S


@triton.jit
def load_workspace(w, qp, kg, gc, bos, seq_len, i_t, i_c, i_h,
                   H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """Chunk i_t's (global index i_c) K-side tiles: w, qp, kg `[C, BK]` in the workspace dtype, G_C `[BK]` fp32."""
    off = (bos * H + i_h) * K
    wt = load_tokens(w + off, seq_len, H, K, i_t * C, 0, C, BK)
    qpt = load_tokens(qp + off, seq_len, H, K, i_t * C, 0, C, BK)
    kgt = load_tokens(kg + off, seq_len, H, K, i_t * C, 0, C, BK)
    cols = tl.arange(0, BK)
    G_C = tl.load(gc + (i_c.to(tl.int64) * H + i_h) * K + cols, mask=cols < K, other=0.0)
    return wt, qpt, kgt, G_C


@triton.jit
def inter_fwd_kernel(
    w, qp, kg, u, ou, gc,  # phase-1 workspace
    h0, o, ht, states,  # `[N, H, K, V]` in, `[*, H, V]`, `[N, H, K, V]` fp32, `[NC, H, K, V]` out
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    USE_H0: tl.constexpr, STORE_O: tl.constexpr, STORE_HT: tl.constexpr, STORE_STATES: tl.constexpr,
):
    """Phase 2 forward. STORE_STATES keeps the state entering every chunk (the backward's recompute)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = sequence_of(cu_seqlens, i_n)
    boc = tl.load(chunk_offsets + i_n)
    col = i_v * BV
    off_v = (bos * H + i_h) * V
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S = load_state(h0 + i_nh.to(tl.int64) * K * V, K, V, col, BK, BV).to(tl.float32)
    for i_t in range(tl.cdiv(seq_len, C)):
        i_c = boc + i_t
        if STORE_STATES:
            store_state(states + (i_c.to(tl.int64) * H + i_h) * K * V, S, K, V, col, BK, BV)
        wt, qpt, kgt, G_C = load_workspace(w, qp, kg, gc, bos, seq_len, i_t, i_c, i_h, H, K, C, BK)
        ut = load_tokens(u + off_v, seq_len, H, V, i_t * C, col, C, BV).to(tl.float32)
        out = load_tokens(ou + off_v, seq_len, H, V, i_t * C, col, C, BV).to(tl.float32)
        ot, S = inter_step(S, wt, qpt, kgt, ut, out, G_C, PREC)
        if STORE_O:
            store_tokens(o + off_v, ot, seq_len, H, V, i_t * C, col, C, BV)
    if STORE_HT:
        store_state(ht + i_nh.to(tl.int64) * K * V, S, K, V, col, BK, BV)


@triton.jit
def inter_bwd_kernel(
    w, qp, kg, gc,  # phase-1 workspace
    do, dht, dh0, dstates, dvn,  # `[*, H, V]`, `[N, H, K, V]` in/out, `[NC, H, K, V]`, `[*, H, V]` fp32 out
    cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
):
    """Phase 2 backward, last chunk first: dstates[c] is the gradient of the state leaving chunk c."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = sequence_of(cu_seqlens, i_n)
    boc = tl.load(chunk_offsets + i_n)
    col = i_v * BV
    off_v = (bos * H + i_h) * V
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS = load_state(dht + i_nh.to(tl.int64) * K * V, K, V, col, BK, BV).to(tl.float32)
    num_chunks = tl.cdiv(seq_len, C)
    for j in range(num_chunks):
        i_t = num_chunks - 1 - j
        i_c = boc + i_t
        store_state(dstates + (i_c.to(tl.int64) * H + i_h) * K * V, dS, K, V, col, BK, BV)
        wt, qpt, kgt, G_C = load_workspace(w, qp, kg, gc, bos, seq_len, i_t, i_c, i_h, H, K, C, BK)
        dot_ = load_tokens(do + off_v, seq_len, H, V, i_t * C, col, C, BV).to(wt.dtype)
        # dV' reaches dv and dbeta directly: fp32 operands (a tf32 MMA for 16-bit inputs) halve their error
        dvt = tl.dot(kgt.to(tl.float32), dS, input_precision=PREC)
        dS = dS * tl.exp(G_C)[:, None] + tl.dot(tl.trans(qpt), dot_, input_precision=PREC)
        dS -= tl.dot(tl.trans(wt), dvt.to(wt.dtype), input_precision=PREC)
        store_tokens(dvn + off_v, dvt, seq_len, H, V, i_t * C, col, C, BV)
    if STORE_DH0:
        store_state(dh0 + i_nh.to(tl.int64) * K * V, dS, K, V, col, BK, BV)
