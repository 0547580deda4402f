"""The slot map: where each pair of one rank goes, from a plan's expert-line tables, and the counts and
rows an all-to-all needs. Fixed-shape tensor programs, no host sync (they compile with the planner).

Legend (as in `k3sys.ep.planner`): R ranks, E experts, s tokens and K picks per rank. The plan's
tables: src_start `[R, E]` line position of rank r's first pair of e; run_end `[E * R]` line end of
run (e, r), e-major (the stretch of e's pairs that rank r computes); row_shift `[E * R]` line position
minus destination row, per run.
"""

from __future__ import annotations

import torch

__all__ = ["pieces", "recv_rows", "slot_map", "traffic_of"]


def pieces(
    tpe: torch.Tensor, src_start: torch.Tensor, run_end: torch.Tensor, row_shift: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source, destination, first destination row, pairs) `[2 * E * R]` of every stretch of the
    expert line that one source sends to one destination run (stretches of 0 pairs included)."""
    R = tpe.shape[0]
    src_end = (src_start + tpe).t().reshape(-1)  # line end of (expert, source) runs
    cuts = torch.sort(torch.cat([src_end, run_end])).values
    starts = torch.cat([cuts.new_zeros(1), cuts[:-1]])
    last = run_end.numel() - 1
    run = torch.searchsorted(run_end, starts, right=True).clamp(max=last)
    src = torch.searchsorted(src_end, starts, right=True).clamp(max=last) % R
    return src, run % R, starts - row_shift[run], cuts - starts


def traffic_of(
    tpe: torch.Tensor, alloc: torch.Tensor, src_start: torch.Tensor, run_end: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Plan.traffic_of` from the plan's tensors (fixed-shape, no sync)."""
    E, R = alloc.shape
    run_end = run_end.view(E, R)
    run_start = run_end - alloc
    src_end = src_start + tpe  # [R, E]
    send = (torch.minimum(src_end[rank].unsqueeze(1), run_end)
            - torch.maximum(src_start[rank].unsqueeze(1), run_start)).clamp(min=0).sum(0)
    recv = (torch.minimum(src_end, run_end[:, rank])
            - torch.maximum(src_start, run_start[:, rank])).clamp(min=0).sum(1)
    return send, recv


def recv_rows(
    tpe: torch.Tensor, src_start: torch.Tensor, run_end: torch.Tensor, row_shift: torch.Tensor, buffer_rows: int,
    rank: int,
) -> torch.Tensor:
    """`Plan.recv_rows_padded` from the plan's tensors (fixed-shape, no sync)."""
    src, dst, row, size = pieces(tpe, src_start, run_end, row_shift)
    size = torch.where(dst == rank, size, 0)
    order = torch.argsort(torch.where(size > 0, src * buffer_rows + row, tpe.shape[0] * buffer_rows))
    row, size = row[order], size[order]
    end = size.cumsum(0)
    i = torch.arange(buffer_rows, device=row.device)
    piece = torch.searchsorted(end, i, right=True).clamp(max=end.numel() - 1)
    return torch.where(i < end[-1], row[piece] + i - (end[piece] - size[piece]), -1)


def slot_map(
    src_start_e: torch.Tensor, run_end: torch.Tensor, row_shift: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst_rank, dst_row) `[s, K]` of one rank's pairs (-1 for a -1 id) from its `[E]` line starts and
    the plan's `[E * R]` run tables: a fixed-shape tensor program, no sync."""
    E = src_start_e.numel()
    R = run_end.numel() // E
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    # int32 keys (-1 ids sort last, into a dummy expert E): the stable sort moves half the bytes.
    key = torch.where(flat >= 0, flat, E).to(torch.int32)
    key, order = torch.sort(key, stable=True)
    # In expert order each pair's line position is its rank's start for the expert plus its index among
    # the rank's pairs of that expert ((token, k) order, as the sort is stable): ascending, so the
    # run search below reads the table front to back (4x faster than in pair order on a CPU). The
    # start and the expert's first sorted index (E + 1 searches in the sorted keys, not a scatter of
    # every pair) fold into one [E + 1] table: one gather per pair.
    first = torch.searchsorted(key, torch.arange(E + 1, dtype=torch.int32, device=flat.device))
    offset = torch.cat([src_start_e, src_start_e.new_zeros(1)]) - first
    pos = offset[key] + torch.arange(n, device=flat.device)
    run = torch.searchsorted(run_end, pos, right=True).clamp(max=run_end.numel() - 1)
    # run = e * R + rank inside the pair's own expert e = key: a subtraction, not an int64 modulo.
    out = torch.where((key < E).unsqueeze(1), torch.stack([run - key * R, pos - row_shift[run]], 1), -1)
    # One scatter of (rank, row) back to pair order.
    out = torch.empty_like(out).scatter_(0, order.unsqueeze(1).expand(n, 2), out)
    return out[:, 0].view_as(topk_ids), out[:, 1].view_as(topk_ids)
