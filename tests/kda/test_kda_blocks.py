"""kda_chunk's phase 1 in blocks of chunk steps (chunk.step_blocks): the blocks tile the steps, and a call
spanning many blocks equals the token-by-token oracle, with several sequences finishing in different blocks."""

from __future__ import annotations

import torch
from kda_inputs import make_inputs

from k3sys.kda import kda_chunk, kda_naive
from k3sys.kda.chunk import PHASE1_ROWS, chunk_layout, step_blocks


def test_step_blocks_tile_the_steps_within_the_row_budget() -> None:
    active = [5, 5, 4, 4, 4, 2, 1, 1, 1, 1]
    blocks = step_blocks(active, rows_per_step=3, max_rows=20)
    assert blocks[0][0] == 0 and blocks[-1][1] == len(active)
    assert all(b0[1] == b1[0] for b0, b1 in zip(blocks, blocks[1:], strict=False))
    assert all(sum(active[a:b]) * 3 <= 20 for a, b in blocks)
    assert step_blocks([100], rows_per_step=4, max_rows=8) == [(0, 1)]  # one step over the budget stays whole


def test_many_blocks_match_naive_fp64() -> None:
    H, C = 2, 16
    steps_per_block = PHASE1_ROWS // (H * C)
    T = 3 * steps_per_block * C + 40  # three full blocks and a partial one for the longest sequence
    cu = torch.tensor([0, 300, T - 500, T])
    q, k, v, g, beta = make_inputs(1, T, H, 8, 8, seed=11)
    h0 = torch.randn(3, H, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    o, S = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=C)
    o_ref, S_ref = kda_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    layout = chunk_layout(cu[1:] - cu[:-1], cu[:-1], C, H)
    assert len(step_blocks(layout.active, H * C)) >= 4  # really several blocks
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
