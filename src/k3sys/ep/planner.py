"""Online redundant-expert planner: exact per-rank slot counts, replica placement and the slot map.

Legend: R ranks, E experts, epn = E / R, K top-k, s_r tokens on rank r this step, S the buffer
capacity in tokens per rank (s_r <= S). Expert e lives at home on rank e // epn; every rank also has
epn replica slots. tpe[r, e] = token-k pairs rank r routes to expert e.

The expert line: the pairs of all ranks are laid out expert by expert, inside an expert by source
rank, inside a rank in (token, k) order. Each expert's stretch is cut into contiguous runs, one per
destination rank in ascending rank order, of alloc[e, r] pairs each. A pair's destination is the run
its line position falls in, so every rank computes its own pairs' slots from the global tpe alone.
On a destination, run (e, r) occupies rows [row_start, row_start + alloc[e, r]) inside e's group.

Strategies (k3sys.ep.matching): "match" (default) moves the lower bound of pairs,
sum_r max(0, home load - cap), unless a rank's last replica slot forces a group to send more, and
uses fewer copies than "greedy", the published MoonEP policy (docs/ep.md has the measured sweep).
"greedy" is kept for comparison and as the fallback when "match" cannot fit a rank's replicas into
its epn slots. Both meet every cap exactly and never use more than epn replica slots on a rank.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from k3sys.ep.matching import cut_quotas, greedy_quotas, match_quotas

__all__ = ["Plan", "plan"]

STRATEGIES = ("match", "greedy")


@dataclass(frozen=True, eq=False)
class Plan:
    """One step's placement. Identical on every rank given the same tpe (no randomness, stable sorts).

    Tensors are int64 on tpe's device.
    - cap `[R]`: slots each rank is planned to receive; floor(total*K/R), the first total*K mod R ranks
      one more.
    - limit `[R]`: the most slots a rank may receive: cap, or floor((1 + tolerance) * cap).
    - alloc `[E, R]`: pairs of expert e processed on rank r.
    - replicas `[R, epn]`: expert id in each replica slot, ascending, -1 for an unused slot.
    - cu_seqlens `[R, 2*epn]`: padded end row of each group on each rank: the epn home experts, then
      the epn replica slots; an empty group takes no rows.
    - buffer_rows: rows of the static receive buffer, NvS = align_up(rows_cap + (token_padding - 1) *
      2*epn, token_padding), where rows_cap = S*K (or floor((1 + tolerance) * S*K)) for capacity S.
    - moved_tokens: pairs processed away from their expert's home; num_copies: (expert, rank)
      replicas holding at least one pair.
    """

    cap: torch.Tensor
    limit: torch.Tensor
    alloc: torch.Tensor
    replicas: torch.Tensor
    cu_seqlens: torch.Tensor
    buffer_rows: int
    moved_tokens: int
    num_copies: int
    tpe: torch.Tensor
    top_k: int
    strategy: str  # the strategy that produced the plan (after any fallback)
    _src_start: torch.Tensor = field(repr=False)  # [R, E] line position of rank r's first pair of e
    _run_end: torch.Tensor = field(repr=False)  # [E * R] line end of run (e, r), e-major
    _row_shift: torch.Tensor = field(repr=False)  # [E * R] line position minus destination row, per run

    @property
    def num_ranks(self) -> int:
        return self.alloc.shape[1]

    @property
    def num_experts(self) -> int:
        return self.alloc.shape[0]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def loads(self) -> torch.Tensor:
        """`[R]` pairs each rank processes (== cap with tolerance 0)."""
        return self.alloc.sum(0)

    @property
    def moved_lower_bound(self) -> int:
        """No plan moves fewer pairs: sum over ranks of the home load above the limit."""
        R = self.num_ranks
        home = self.tpe.sum(0).view(R, -1).sum(1)
        return int((home - self.limit).clamp(min=0).sum())

    def slots(self, rank: int, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each of `rank`'s token-k pairs goes: (dst_rank `[s, K]`, dst_row `[s, K]`).

        `topk_ids` `[s, K]` must be the routing that tpe[rank] counts. Rows are unique per destination
        and lie inside the pair's expert group there (its home group, or its replica slot).
        """
        R, E = self.num_ranks, self.num_experts
        if not 0 <= rank < R:
            raise ValueError(f"rank must be in [0, {R}), got {rank}")
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.top_k:
            raise ValueError(f"topk_ids must have shape [s, K={self.top_k}], got {list(topk_ids.shape)}")
        flat = topk_ids.reshape(-1).long().to(self.tpe.device)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= E):
            raise ValueError(f"topk_ids must lie in [0, {E}), got [{int(flat.min())}, {int(flat.max())}]")
        counts = torch.bincount(flat, minlength=E)
        if not torch.equal(counts, self.tpe[rank]):
            bad = int(torch.nonzero(counts != self.tpe[rank])[0])
            raise ValueError(
                f"topk_ids of rank {rank} route {int(counts[bad])} pairs to expert {bad}, "
                f"but the plan's tpe[{rank}, {bad}] is {int(self.tpe[rank, bad])}"
            )
        # Index of each pair among this rank's pairs of the same expert, in (token, k) order.
        order = torch.argsort(flat, stable=True)
        first = counts.cumsum(0) - counts
        within = torch.empty_like(flat)
        within[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
        pos = self._src_start[rank, flat] + within
        run = torch.searchsorted(self._run_end, pos, right=True)
        return (run % R).view_as(topk_ids), (pos - self._row_shift[run]).view_as(topk_ids)

    def traffic(self) -> torch.Tensor:
        """`[R, R]` pairs each source rank sends to each destination rank (its own row included).

        Row r gives rank r's all-to-all send counts, column r its receive counts.
        """
        R = self.num_ranks
        src, dst, _, size = self._pieces()
        return torch.zeros(R * R, dtype=torch.long, device=size.device).index_add_(0, src * R + dst, size).view(R, R)

    def traffic_of(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(`[R]` send counts, `[R]` receive counts) of `rank`: row and column `rank` of `traffic()`,
        from the overlaps of its line runs with the destination runs, in O(E * R) (what a runtime
        needs every step; the whole table costs a sort of all 2 * E * R run boundaries)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        R, E = self.num_ranks, self.num_experts
        run_end = self._run_end.view(E, R)
        run_start = run_end - self.alloc
        src_start, src_end = self._src_start, self._src_start + self.tpe  # [R, E]
        send = (torch.minimum(src_end[rank].unsqueeze(1), run_end)
                - torch.maximum(src_start[rank].unsqueeze(1), run_start)).clamp(min=0).sum(0)
        recv = (torch.minimum(src_end, run_end[:, rank])
                - torch.maximum(src_start, run_start[:, rank])).clamp(min=0).sum(1)
        return send, recv

    def recv_rows(self, rank: int) -> torch.Tensor:
        """`[n]` destination rows of the pairs `rank` receives, in the order an all-to-all delivers them
        when every source packs its pairs for each destination sorted by dst_row: by source rank,
        then by row. n = traffic()[:, rank].sum()."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        src, dst, row, size = self._pieces()
        mine = dst == rank
        src, row, size = src[mine], row[mine], size[mine]
        order = torch.argsort(src * self.buffer_rows + row)  # keys are unique: rows differ within a source
        row, size = row[order], size[order]
        first = torch.repeat_interleave(row - (size.cumsum(0) - size), size)
        return first + torch.arange(int(size.sum()), device=row.device)

    def _pieces(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(source, destination, first destination row, pairs) of every stretch of the expert line
        that one source sends to one destination run."""
        R = self.num_ranks
        src_end = (self._src_start + self.tpe).t().reshape(-1)  # line end of (expert, source) runs
        cuts = torch.unique(torch.cat([src_end, self._run_end]))
        starts = torch.cat([cuts.new_zeros(1), cuts[:-1]])
        size = cuts - starts
        keep = size > 0
        starts, size = starts[keep], size[keep]
        run = torch.searchsorted(self._run_end, starts, right=True)
        src = torch.searchsorted(src_end, starts, right=True) % R
        return src, run % R, starts - self._row_shift[run], size


def _align_up(x: int | torch.Tensor, multiple: int) -> int | torch.Tensor:
    return (x + multiple - 1) // multiple * multiple


def _check(
    tpe: torch.Tensor, top_k: int, tokens_per_rank: int | None, total_tokens: int | None, token_padding: int
) -> tuple[int, int]:
    """Validate the plan() inputs; returns (tokens per rank capacity S, epn)."""
    if tpe.dim() != 2:
        raise ValueError(f"tpe must be 2-D [R, E], got shape {list(tpe.shape)}")
    if tpe.dtype.is_floating_point or tpe.dtype.is_complex or tpe.dtype == torch.bool:
        raise ValueError(f"tpe must hold integer counts, got {tpe.dtype}")
    R, E = tpe.shape
    if R < 1 or E < 1 or E % R:
        raise ValueError(f"E ({E}) must be a positive multiple of R ({R})")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    if token_padding < 1:
        raise ValueError(f"token_padding must be >= 1, got {token_padding}")
    if tpe.numel() and int(tpe.min()) < 0:
        raise ValueError(f"tpe counts must be >= 0, got {int(tpe.min())}")
    pairs = tpe.sum(1)
    if bool((pairs % top_k != 0).any()):
        r = int(torch.nonzero(pairs % top_k)[0])
        raise ValueError(f"tpe row {r} sums to {int(pairs[r])}, not a multiple of top_k={top_k} (s*K)")
    tokens = pairs // top_k
    if bool((tpe > tokens.view(R, 1)).any()):
        r = int(torch.nonzero((tpe > tokens.view(R, 1)).any(1))[0])
        raise ValueError(f"tpe row {r} routes more than its s={int(tokens[r])} tokens to one expert")
    if total_tokens is None:
        if bool((pairs != pairs[0]).any()):
            raise ValueError(
                f"tpe rows must all sum to s*K (same s on every rank), got {pairs.tolist()}; "
                "pass total_tokens for uneven per-rank token counts"
            )
    elif int(pairs.sum()) != total_tokens * top_k:
        raise ValueError(f"tpe sums to {int(pairs.sum())} pairs, but total_tokens*K = {total_tokens * top_k}")
    s_max = int(tokens.max())
    if tokens_per_rank is None:
        return s_max, E // R
    if tokens_per_rank < s_max:
        raise ValueError(f"tokens_per_rank (capacity S={tokens_per_rank}) is below this step's s={s_max}")
    return tokens_per_rank, E // R


def plan(
    tpe: torch.Tensor,
    top_k: int,
    tokens_per_rank: int | None = None,
    total_tokens: int | None = None,
    token_padding: int = 1,
    *,
    strategy: str = "match",
    tolerance: float = 0.0,
    ranks_per_node: int | None = None,
) -> Plan:
    """Plan one step's placement from the global token counts.

    Args:
        tpe: `[R, E]` integer pairs each source rank routes to each expert (all-gathered), E % R == 0.
        top_k: K; each row of tpe sums to s_r * K.
        tokens_per_rank: buffer capacity S in tokens per rank (s_r <= S), which sizes buffer_rows, so a
            runtime that allocates once for S gets the same buffer_rows every step. Default: this
            step's largest s_r.
        total_tokens: sum_r s_r, for uneven per-rank token counts; None requires the same s on every
            rank (every tpe row sums to s*K).
        token_padding: every group is padded to a multiple of this many rows (GEMM tile alignment).
        strategy: "match" (default) or "greedy" (the published MoonEP policy), see the module doc.
        tolerance: 0 for exact caps; > 0 lets "match" leave a rank up to floor((1 + tolerance) * cap)
            loaded, which moves fewer tokens with fewer copies.
        ranks_per_node: if given, "match" places each node's surplus inside the node first, so most
            replica weights travel over the node's fast links.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance}")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    S, epn = _check(tpe, top_k, tokens_per_rank, total_tokens, token_padding)
    tpe = tpe.long()
    R, E = tpe.shape
    dev = tpe.device
    load = tpe.sum(0)
    slots = int(load.sum())
    cap = slots // R + (torch.arange(R, device=dev) < slots % R).long()
    limit = cap + (cap.double() * tolerance).floor().long()
    alloc, used = _place(load, cap, limit, strategy, tolerance == 0, ranks_per_node)
    rows_cap = S * top_k + int(S * top_k * tolerance)  # >= every rank's limit, as cap <= S*K
    buffer_rows = _align_up(rows_cap + (token_padding - 1) * 2 * epn, token_padding)
    return _finalize(tpe, alloc, cap, limit, top_k, buffer_rows, token_padding, used)


def _place(
    load: torch.Tensor, cap: torch.Tensor, limit: torch.Tensor, strategy: str, exact: bool, ranks_per_node: int | None
) -> tuple[torch.Tensor, str]:
    """alloc `[E, R]` from `[E]` expert loads, and the strategy that produced it."""
    R, E = cap.numel(), load.numel()
    epn = E // R
    expert_load = load.view(R, epn).tolist()
    group_load = [sum(g) for g in expert_load]
    pieces = None
    # A tolerance so small that it leaves almost no slack can make the inexact match run out of
    # room; the exact match then still beats the greedy fallback.
    attempts = [(limit, exact)] + ([] if exact else [(cap, True)])
    while strategy == "match" and pieces is None and attempts:
        bound, exact_caps = attempts.pop(0)
        quotas = match_quotas(group_load, bound.tolist(), epn, exact_caps, ranks_per_node)
        pieces = None if quotas is None else cut_quotas(quotas, expert_load)
        if pieces and max(Counter(d for _, d, _ in pieces).values()) > epn:
            pieces = None  # a quota split over several experts overfilled a rank's slots
    used = strategy if pieces is not None else "greedy"
    if pieces is None:
        pieces = cut_quotas(greedy_quotas(group_load, cap.tolist()), expert_load)
    e, d, n = torch.tensor(pieces, dtype=torch.long, device=load.device).view(-1, 3).unbind(1)
    alloc = torch.zeros(E, R, dtype=torch.long, device=load.device)
    experts = torch.arange(E, device=load.device)
    alloc[experts, experts // epn] = load - torch.zeros_like(load).index_add_(0, e, n)
    alloc.view(-1).index_add_(0, e * R + d, n)
    return alloc, used


def _finalize(
    tpe: torch.Tensor, alloc: torch.Tensor, cap: torch.Tensor, limit: torch.Tensor, top_k: int,
    buffer_rows: int, token_padding: int, strategy: str,
) -> Plan:
    """Derive replicas, the padded group layout and the slot-map tables from alloc."""
    R, E = tpe.shape
    epn = E // R
    dev = tpe.device
    experts = torch.arange(E, device=dev)
    home = experts // epn
    remote = alloc.clone()
    remote[experts, home] = 0
    # Replica slots: each rank's remote experts in ascending id (nonzero is row-major, so sorted).
    rank, expert = torch.nonzero(remote.t(), as_tuple=True)
    per_rank = torch.bincount(rank, minlength=R)
    slot = torch.arange(rank.numel(), device=dev) - (per_rank.cumsum(0) - per_rank)[rank]
    if bool((slot >= epn).any()):
        raise AssertionError(f"plan needs {int(per_rank.max())} replica slots on a rank, only {epn} exist")
    replicas = torch.full((R, epn), -1, dtype=torch.long, device=dev)
    replicas[rank, slot] = expert
    groups = torch.zeros(R, 2 * epn, dtype=torch.long, device=dev)
    groups[:, :epn] = alloc[experts, home].view(R, epn)
    groups[rank, epn + slot] = remote[expert, rank]
    padded = _align_up(groups, token_padding)
    cu_seqlens = padded.cumsum(1)
    group_start = cu_seqlens - padded
    row_start = torch.zeros(E, R, dtype=torch.long, device=dev)
    row_start[experts, home] = group_start[:, :epn].reshape(-1)
    row_start[expert, rank] = group_start[rank, epn + slot]
    load = alloc.sum(1)
    expert_base = load.cumsum(0) - load
    run_end = expert_base.view(E, 1) + alloc.cumsum(1)
    return Plan(
        cap=cap,
        limit=limit,
        alloc=alloc,
        replicas=replicas,
        cu_seqlens=cu_seqlens,
        buffer_rows=buffer_rows,
        moved_tokens=int(remote.sum()),
        num_copies=int(rank.numel()),
        tpe=tpe,
        top_k=top_k,
        strategy=strategy,
        _src_start=expert_base.view(1, E) + tpe.cumsum(0) - tpe,
        _run_end=run_end.reshape(-1),
        _row_shift=(run_end - alloc - row_start).reshape(-1),
    )
