"""Phase 2, recurrent: one program per (V-tile, sequence x head) walks its chunks with the state on chip.

Per chunk, from phase 1's workspace and the fp32 state S `[K, BV]` entering it:
    V' = U - W S;   O = qg S + Aqk V';   S <- Diag(e^G_C) S + kg^T V'
and backwards, with dS the gradient of the state leaving the chunk:
    dV' = Aqk^T dO + kg dS;   dS <- Diag(e^G_C) dS + qg^T dO - W^T dV'
The dot operands are in the workspace dtype (bf16/fp16 tensor-core MMAs, or fp32 with IEEE products),
accumulating in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3sys.kda.triton.intra import load_state, load_tokens, sequence_of, store_state, store_tokens


@triton.jit
def inter_step(S, w, u, qg, kg, aqk, G_C, PREC: tl.constexpr):
    """One chunk of the recurrence: fp32 state `[BK, BV]` in, (O `[C, BV]`, state out) in fp32.

    w, qg, kg `[C, BK]` come in the dot operand dtype; u `[C, BV]`, aqk `[C, C]` and G_C `[BK]` in fp32.
    """
    Sd = S.to(w.dtype)
    vn = u - tl.dot(w, Sd, input_precision=PREC)
    # O's intra-chunk term carries V' straight to the output: fp32 operands (tf32 MMA for 16-bit inputs)
    # keep its rounding under the output's own; in bf16 this halves O's error against fp64.
    o = tl.dot(qg, Sd, input_precision=PREC) + tl.dot(aqk, vn, input_precision=PREC)
    S = S * tl.exp(G_C)[:, None] + tl.dot(tl.trans(kg), vn.to(w.dtype), input_precision=PREC)
    return o, S


@triton.jit
def load_workspace(w, qg, kg, aqk, gc, bos, seq_len, i_t, i_c, i_h,
                   H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """Chunk i_t's (global index i_c) phase-1 tiles.

    Returns w, qg, kg `[C, BK]` in the workspace dtype (dot operands), aqk `[C, C]` and G_C `[BK]` in fp32.
    """
    off = (bos * H + i_h) * K
    wt = load_tokens(w + off, seq_len, H, K, i_t * C, 0, C, BK)
    qgt = load_tokens(qg + off, seq_len, H, K, i_t * C, 0, C, BK)
    kgt = load_tokens(kg + off, seq_len, H, K, i_t * C, 0, C, BK)
    at = load_tokens(aqk + (bos * H + i_h) * C, seq_len, H, C, i_t * C, 0, C, C)
    cols = tl.arange(0, BK)
    G_C = tl.load(gc + (i_c.to(tl.int64) * H + i_h) * K + cols, mask=cols < K, other=0.0)
    return wt, qgt, kgt, at, G_C


@triton.jit
def inter_fwd_kernel(
    w, u, qg, kg, aqk, gc,  # phase-1 workspace
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
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S = load_state(h0 + i_nh.to(tl.int64) * K * V, K, V, col, BK, BV).to(tl.float32)
    for i_t in range(tl.cdiv(seq_len, C)):
        i_c = boc + i_t
        if STORE_STATES:
            store_state(states + (i_c.to(tl.int64) * H + i_h) * K * V, S, K, V, col, BK, BV)
        wt, qgt, kgt, at, G_C = load_workspace(w, qg, kg, aqk, gc, bos, seq_len, i_t, i_c, i_h, H, K, C, BK)
        ut = load_tokens(u + (bos * H + i_h) * V, seq_len, H, V, i_t * C, col, C, BV).to(tl.float32)
        ot, S = inter_step(S, wt, ut, qgt, kgt, at, G_C, PREC)
        if STORE_O:
            store_tokens(o + (bos * H + i_h) * V, ot, seq_len, H, V, i_t * C, col, C, BV)
    if STORE_HT:
        store_state(ht + i_nh.to(tl.int64) * K * V, S, K, V, col, BK, BV)


@triton.jit
def inter_bwd_kernel(
    w, qg, kg, aqk, gc,  # phase-1 workspace
    do, dht, dh0, dstates, dvn,  # `[*, H, V]`, `[N, H, K, V]` in/out, `[NC, H, K, V]`, `[*, H, V]` out
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
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS = load_state(dht + i_nh.to(tl.int64) * K * V, K, V, col, BK, BV).to(tl.float32)
    num_chunks = tl.cdiv(seq_len, C)
    for j in range(num_chunks):
        i_t = num_chunks - 1 - j
        i_c = boc + i_t
        store_state(dstates + (i_c.to(tl.int64) * H + i_h) * K * V, dS, K, V, col, BK, BV)
        wt, qgt, kgt, at, G_C = load_workspace(w, qg, kg, aqk, gc, bos, seq_len, i_t, i_c, i_h, H, K, C, BK)
        dot_ = load_tokens(do + (bos * H + i_h) * V, seq_len, H, V, i_t * C, col, C, BV).to(tl.float32)
        # dV' feeds dv and dbeta directly: fp32 operands (tf32 MMA) here, as for O's V' term forwards
        dvt = tl.dot(tl.trans(at), dot_, input_precision=PREC) + tl.dot(kgt.to(tl.float32), dS, input_precision=PREC)
        dS = dS * tl.exp(G_C)[:, None] + tl.dot(tl.trans(qgt), dot_.to(wt.dtype), input_precision=PREC)
        dS -= tl.dot(tl.trans(wt), dvt.to(wt.dtype), input_precision=PREC)
        store_tokens(dvn + (bos * H + i_h) * V, dvt, seq_len, H, V, i_t * C, col, C, BV)
    if STORE_DH0:
        store_state(dh0 + i_nh.to(tl.int64) * K * V, dS, K, V, col, BK, BV)
