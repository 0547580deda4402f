"""Both phases in one kernel (forward only): the baseline that measures what the two-kernel split buys.

Each (V-tile, sequence x head) program recomputes phase 1 for its chunk inside the recurrent loop, so the
token-parallel work sits on the serial path and is repeated per V-tile. Benchmark use only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3sys.kda.triton.inter import inter_step
from k3sys.kda.triton.intra import (
    chunk_products,
    load_chunk_inputs,
    load_state,
    load_tokens,
    sequence_of,
    store_state,
    store_tokens,
)


@triton.jit
def fused_fwd_kernel(
    q, k, v, g, beta, h0, o, ht,
    cu_seqlens, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len = sequence_of(cu_seqlens, i_n)
    col = i_v * BV
    dt = q.dtype.element_ty
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S = load_state(h0 + i_nh.to(tl.int64) * K * V, K, V, col, BK, BV).to(tl.float32)
    for i_t in range(tl.cdiv(seq_len, C)):
        qt, kt, gt, bt = load_chunk_inputs(q, k, g, beta, bos, seq_len, i_t, i_h, H, K, C, BK)
        vt = load_tokens(v + (bos * H + i_h) * V, seq_len, H, V, i_t * C, col, C, BV).to(tl.float32)
        W, Qp, KG, U, Ou, G_C = chunk_products(qt, kt, gt, bt, vt, scale, C, PREC)
        ot, S = inter_step(S, W.to(dt), Qp.to(dt), KG.to(dt), U, Ou, G_C, PREC)
        store_tokens(o + (bos * H + i_h) * V, ot, seq_len, H, V, i_t * C, col, C, BV)
    if STORE_HT:
        store_state(ht + i_nh.to(tl.int64) * K * V, S, K, V, col, BK, BV)
