"""Gradient of phase 1 and of phase 2's per-chunk products: one program per (chunk, head), token-parallel.

Inputs are the chunk's raw q, k, v, g, beta (phase 1 is recomputed here, not stored), the state entering
the chunk S and the gradient dS of the state leaving it (both `[NC, H, K, V]` from phase 2), dO, and
dV' = kg dS from the reverse recurrence. Through O = Q' S + Ou, V' = U - W S, S' = Diag(e^G_C) S + kg^T V',
with V' recomputed per V-tile:
    dQ' = dO S^T   dkg = V' dS^T   dU = Aqk^T dO + dV'   dW = -dV' S^T - Aqk^T dQ'
    dAqk = dO U^T - dQ' W^T   dqg = dQ'   dG_C += e^G_C sum_v S dS
then back through W = T Diag(beta)(K e^G), U = T Diag(beta) V, T = (I + L)^-1 (dL = -T^T dT T^T),
L and Aqk (pairwise decays split at row r), qg, kg, and finally G = cumsum(g) (dg = reverse cumsum of dG).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3sys.kda.triton.intra import (
    chunk_decays,
    chunk_inverse,
    chunk_qk,
    load_chunk_inputs,
    load_state,
    load_tokens,
    sequence_of,
    store_tokens,
)


@triton.jit
def intra_bwd_kernel(
    q, k, v, g, beta,  # inputs
    states, dstates, do, dvn,  # `[NC, H, K, V]` x2, `[*, H, V]` x2
    dq, dk, dv, dg, dbeta,  # outputs, shaped like the inputs
    cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i_t = tl.load(chunk_indices + 2 * i_c + 1)
    bos, seq_len = sequence_of(cu_seqlens, i_n)
    # Only T, Aqk, W and beta live through the V loop; q, k, g are loaded again after it (cache hits)
    # rather than held, which keeps the loop's register set small enough not to spill.
    qt, kt, gt, bt = load_chunk_inputs(q, k, g, beta, bos, seq_len, i_t, i_h, H, K, C, BK)
    _, Er, Fr, E, _, _ = chunk_decays(gt, C)
    T = chunk_inverse(kt, bt, Er, Fr, C, PREC)
    Aqk = chunk_qk(qt, kt, Er, Fr, scale, C, PREC)
    dt = states.dtype.element_ty
    W = tl.dot(T, bt[:, None] * kt * E, input_precision=PREC).to(dt)

    dQp = tl.zeros([C, BK], dtype=tl.float32)
    dW = tl.zeros([C, BK], dtype=tl.float32)
    dkg = tl.zeros([C, BK], dtype=tl.float32)
    dAqk = tl.zeros([C, C], dtype=tl.float32)
    dT = tl.zeros([C, C], dtype=tl.float32)
    dG_C = tl.zeros([BK], dtype=tl.float32)
    db = tl.zeros([C], dtype=tl.float32)
    s_off = (i_c.to(tl.int64) * H + i_h) * K * V
    v_off = (bos * H + i_h) * V
    for i_v in range(tl.cdiv(V, BV)):
        col = i_v * BV
        S = load_state(states + s_off, K, V, col, BK, BV)
        dS = load_state(dstates + s_off, K, V, col, BK, BV)
        vt = load_tokens(v + v_off, seq_len, H, V, i_t * C, col, C, BV).to(tl.float32)
        dot_ = load_tokens(do + v_off, seq_len, H, V, i_t * C, col, C, BV).to(tl.float32)
        dvt = load_tokens(dvn + v_off, seq_len, H, V, i_t * C, col, C, BV).to(tl.float32)
        vb = bt[:, None] * vt
        U = tl.dot(T, vb, input_precision=PREC)
        vn = U - tl.dot(W, S, input_precision=PREC)
        dQp += tl.dot(dot_.to(dt), tl.trans(S), input_precision=PREC)
        dW -= tl.dot(dvt.to(dt), tl.trans(S), input_precision=PREC)
        dkg += tl.dot(vn, tl.trans(dS.to(tl.float32)), input_precision=PREC)
        dAqk += tl.dot(dot_, tl.trans(U), input_precision=PREC)
        dG_C += tl.sum(S.to(tl.float32) * dS.to(tl.float32), axis=1)
        dU = tl.dot(tl.trans(Aqk), dot_, input_precision=PREC) + dvt
        dT += tl.dot(dU, tl.trans(vb), input_precision=PREC)
        dvb = tl.dot(tl.trans(T), dU, input_precision=PREC)
        store_tokens(dv + v_off, bt[:, None] * dvb, seq_len, H, V, i_t * C, col, C, BV)
        db += tl.sum(vt * dvb, axis=1)

    qt, kt, gt, _ = load_chunk_inputs(q, k, g, beta, bos, seq_len, i_t, i_h, H, K, C, BK)
    _, Er, Fr, E, EC, G_C = chunk_decays(gt, C)
    Ke = kt * E
    Kb = bt[:, None] * Ke
    # Q' = qg - Aqk W, W = T Kb
    Wf = tl.dot(T, Kb, input_precision=PREC)
    dAqk -= tl.dot(dQp, tl.trans(Wf), input_precision=PREC)
    dW -= tl.dot(tl.trans(Aqk), dQp, input_precision=PREC)
    dT += tl.dot(dW, tl.trans(Kb), input_precision=PREC)
    dKb = tl.dot(tl.trans(T), dW, input_precision=PREC)
    db += tl.sum(Ke * dKb, axis=1)
    dKe = bt[:, None] * dKb
    # T = (I + L)^-1, L = strict_tril(Diag(beta) Kr Km^T), Aqk = tril(Qr Km^T)
    r = tl.arange(0, C)
    dL = -tl.dot(tl.trans(T), tl.dot(dT, tl.trans(T), input_precision="ieee"), input_precision="ieee")
    dA = tl.where(r[:, None] > r[None, :], dL, 0.0)
    dAq = tl.where(r[:, None] >= r[None, :], dAqk, 0.0)
    Kr, Km, Qr = kt * Er, kt * Fr, scale * qt * Er
    dAKm = tl.dot(dA, Km, input_precision=PREC)
    db += tl.sum(Kr * dAKm, axis=1)
    dKr = bt[:, None] * dAKm
    dKm = tl.dot(tl.trans(bt[:, None] * dA), Kr, input_precision=PREC)
    dKm += tl.dot(tl.trans(dAq), Qr, input_precision=PREC)
    dQr = tl.dot(dAq, Km, input_precision=PREC)
    # the factors' exponents: Kr, Qr, Ke, qg ~ e^+G, Km, kg ~ e^-G, and kg, the state decay ~ e^+G_C
    qg, kg = scale * qt * E, kt * EC
    dq_ = scale * (dQr * Er + dQp * E)
    dk_ = dKr * Er + dKm * Fr + dKe * E + dkg * EC
    dG = dKr * Kr - dKm * Km + dQr * Qr + dKe * Ke + dQp * qg - dkg * kg
    dG_C = tl.sum(dkg * kg, axis=0) + dG_C * tl.exp(G_C)
    dG += tl.where((r == C - 1)[:, None], dG_C[None, :], 0.0)
    dg_ = tl.cumsum(dG, axis=0, reverse=True)

    off = (bos * H + i_h) * K
    store_tokens(dq + off, dq_, seq_len, H, K, i_t * C, 0, C, BK)
    store_tokens(dk + off, dk_, seq_len, H, K, i_t * C, 0, C, BK)
    store_tokens(dg + off, dg_, seq_len, H, K, i_t * C, 0, C, BK)
    t = i_t * C + r
    tl.store(dbeta + (bos + t) * H + i_h, db.to(dbeta.dtype.element_ty), mask=t < seq_len)
