"""Online redundant-expert planner: exact per-rank slot counts, replica placement and the slot map.

Legend: R ranks, E experts, K top-k, s_r tokens on rank r this step, S the buffer capacity in tokens
per rank (s_r <= S). Expert homes come from `k3sys.ep.homes` (E need not be a multiple of R; epn =
ceil(E / R) is the most homes on a rank); every rank also has epn replica slots. tpe[r, e] = token-k
pairs rank r routes to expert e.

The expert line: the pairs of all ranks are laid out expert by expert, inside an expert by source
rank, inside a rank in (token, k) order. Each expert's stretch is cut into contiguous runs, one per
destination rank in ascending rank order, of alloc[e, r] pairs each. A pair's destination is the run
its line position falls in, so every rank computes its own pairs' slots from the global tpe alone.
On a destination, run (e, r) occupies rows [row_start, row_start + alloc[e, r]) inside e's group.
`k3sys.ep.slot_map` turns those tables into each pair's (rank, row), send/receive counts and rows.

Strategies:
- "device" (default): `k3sys.ep.device_match`, a fixed-shape tensor program on tpe's device with no
  host sync (compiles with `torch.compile(fullgraph=True)`, captures in a CUDA graph). Layout and
  slot map below are fixed-shape tensor code too, shared by every strategy.
- "match": the exact host planner (`k3sys.ep.matching`), kept as the oracle: it moves the lower bound
  of pairs, sum_r max(0, home load - limit), unless a rank's last replica slot forces a group to send
  more, with fewer copies than "greedy"; it syncs (a few R-sized host loops).
- "greedy": the published MoonEP policy on the host, for comparison and as "match"'s fallback when
  it cannot fit a rank's replicas into its epn slots.
All meet every cap exactly (or stay within the tolerance's limit) with at most epn replicas per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from k3sys.ep.device_match import device_alloc
from k3sys.ep.homes import Homes
from k3sys.ep.matching import host_alloc
from k3sys.ep.slot_map import pieces, recv_rows, slot_map, traffic_of

__all__ = ["Plan", "PlanTensors", "device_plan", "device_step", "plan", "recv_rows", "slot_map", "traffic_of"]

STRATEGIES = ("device", "match", "greedy")


@dataclass(frozen=True, eq=False)
class Plan:
    """One step's placement. Identical on every rank given the same tpe (no randomness, stable sorts).

    Tensors are int64 on tpe's device.
    - cap `[R]`: slots each rank is planned to receive; floor(total*K/R), the first total*K mod R ranks
      one more.
    - limit `[R]`: the most slots a rank may receive: cap, or floor((1 + tolerance) * cap).
    - alloc `[E, R]`: pairs of expert e processed on rank r.
    - replicas `[R, epn]`: expert id in each replica slot, ascending, -1 for an unused slot.
    - cu_seqlens `[R, 2*epn]`: padded end row of each group on each rank: the epn home slots (a rank
      with fewer homes has empty trailing ones), then the epn replica slots; an empty group takes no rows.
    - buffer_rows: rows of the static receive buffer, NvS = align_up(rows_cap + (token_padding - 1) *
      2*epn, token_padding), where rows_cap = S*K (or floor((1 + tolerance) * S*K)) for capacity S.
    moved_tokens (pairs processed away from their expert's home) and num_copies ((expert, rank)
    replicas holding at least one pair) are host ints computed on access (a sync), never by plan().
    """

    cap: torch.Tensor
    limit: torch.Tensor
    alloc: torch.Tensor
    replicas: torch.Tensor
    cu_seqlens: torch.Tensor
    buffer_rows: int
    tpe: torch.Tensor
    top_k: int
    strategy: str  # the strategy asked for ("match" reports "greedy" after its fallback)
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
    def homes(self) -> Homes:
        return Homes(self.num_experts, self.num_ranks)

    @property
    def experts_per_rank(self) -> int:
        """epn: the most home experts on a rank, and the replica slots per rank."""
        return self.homes.epn

    @property
    def loads(self) -> torch.Tensor:
        """`[R]` pairs each rank processes (== cap with tolerance 0)."""
        return self.alloc.sum(0)

    @property
    def moved_tokens(self) -> int:
        """Pairs processed away from their expert's home (syncs)."""
        experts = torch.arange(self.num_experts, device=self.alloc.device)
        return int(self.alloc.sum() - self.alloc[experts, self.homes.rank_of(experts)].sum())

    @property
    def num_copies(self) -> int:
        """(expert, rank) replicas holding at least one pair (syncs)."""
        return int((self.replicas >= 0).sum())

    @property
    def moved_lower_bound(self) -> int:
        """No plan moves fewer pairs: sum over ranks of the home load above the limit (syncs)."""
        home = self.homes.group_sum(self.tpe.sum(0))
        return int((home - self.limit).clamp(min=0).sum())

    def slots(self, rank: int, topk_ids: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each of `rank`'s token-k pairs goes: (dst_rank `[s, K]`, dst_row `[s, K]`), -1 for a
        `-1` id ("no expert").

        `topk_ids` `[s, K]` must be the routing that tpe[rank] counts. Rows are unique per destination
        and lie inside the pair's expert group there (its home group, or its replica slot). `check`
        validates that on the host first (syncs); the map itself (`slot_map`) never syncs.
        """
        self._check_rank(rank)
        if check:
            self._check_ids(rank, topk_ids)
        return slot_map(self._src_start[rank], self._run_end, self._row_shift, topk_ids.to(self.tpe.device))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")

    def _check_ids(self, rank: int, topk_ids: torch.Tensor) -> None:
        E = self.num_experts
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.top_k:
            raise ValueError(f"topk_ids must have shape [s, K={self.top_k}], got {list(topk_ids.shape)}")
        flat = topk_ids.reshape(-1).long().to(self.tpe.device)
        if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= E):
            raise ValueError(f"topk_ids must lie in [-1, {E}), got [{int(flat.min())}, {int(flat.max())}]")
        counts = torch.bincount(flat[flat >= 0], minlength=E)
        if not torch.equal(counts, self.tpe[rank]):
            bad = int(torch.nonzero(counts != self.tpe[rank])[0])
            raise ValueError(
                f"topk_ids of rank {rank} route {int(counts[bad])} pairs to expert {bad}, "
                f"but the plan's tpe[{rank}, {bad}] is {int(self.tpe[rank, bad])}"
            )

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
        needs every step; the whole table costs a sort of all 2 * E * R run boundaries). No sync."""
        self._check_rank(rank)
        return traffic_of(self.tpe, self.alloc, self._src_start, self._run_end, rank)

    def recv_rows_padded(self, rank: int) -> torch.Tensor:
        """`[buffer_rows]` destination rows of the pairs `rank` receives, in the order an all-to-all
        delivers them when every source packs its pairs for each destination sorted by dst_row: by
        source rank, then by row; -1 past the n = traffic()[:, rank].sum() received. No sync."""
        self._check_rank(rank)
        return recv_rows(self.tpe, self._src_start, self._run_end, self._row_shift, self.buffer_rows, rank)

    def recv_rows(self, rank: int) -> torch.Tensor:
        """`recv_rows_padded(rank)` without its -1 tail: `[n]` (a data-dependent size, so it syncs)."""
        rows = self.recv_rows_padded(rank)
        return rows[: int((rows >= 0).sum())]

    def _pieces(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return pieces(self.tpe, self._src_start, self._run_end, self._row_shift)


class PlanTensors(NamedTuple):
    """The tensors of a `Plan` (what `device_plan` returns; all int64 on tpe's device)."""

    cap: torch.Tensor
    limit: torch.Tensor
    alloc: torch.Tensor
    replicas: torch.Tensor
    cu_seqlens: torch.Tensor
    src_start: torch.Tensor
    run_end: torch.Tensor
    row_shift: torch.Tensor


def _align_up(x: int | torch.Tensor, multiple: int) -> int | torch.Tensor:
    return (x + multiple - 1) // multiple * multiple


def _check(
    tpe: torch.Tensor, top_k: int, tokens_per_rank: int | None, total_tokens: int | None, token_padding: int
) -> int:
    """Validate the plan() inputs on the host (syncs); returns the tokens per rank capacity S."""
    if tpe.dim() != 2:
        raise ValueError(f"tpe must be 2-D [R, E], got shape {list(tpe.shape)}")
    if tpe.dtype.is_floating_point or tpe.dtype.is_complex or tpe.dtype == torch.bool:
        raise ValueError(f"tpe must hold integer counts, got {tpe.dtype}")
    R, E = tpe.shape
    if not 1 <= R <= E:
        raise ValueError(f"tpe must be [R, E] with 1 <= R <= E, got R={R}, E={E}")
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
        return s_max
    if tokens_per_rank < s_max:
        raise ValueError(f"tokens_per_rank (capacity S={tokens_per_rank}) is below this step's s={s_max}")
    return tokens_per_rank


def plan(
    tpe: torch.Tensor,
    top_k: int,
    tokens_per_rank: int | None = None,
    total_tokens: int | None = None,
    token_padding: int = 1,
    *,
    strategy: str = "device",
    tolerance: float = 0.0,
    ranks_per_node: int | None = None,
    validate: bool = True,
) -> Plan:
    """Plan one step's placement from the global token counts.

    Args:
        tpe: `[R, E]` integer pairs each source rank routes to each expert (all-gathered), R <= E.
        top_k: K; each row of tpe sums to s_r * K.
        tokens_per_rank: buffer capacity S in tokens per rank (s_r <= S), which sizes buffer_rows, so a
            runtime that allocates once for S gets the same buffer_rows every step. Default: this
            step's largest s_r (a sync).
        total_tokens: sum_r s_r, for uneven per-rank token counts; None requires the same s on every
            rank (every tpe row sums to s*K). Only validation reads it.
        token_padding: every group is padded to a multiple of this many rows (GEMM tile alignment).
        strategy: "device" (default), "match" (the exact host oracle) or "greedy" (MoonEP), see the
            module doc.
        tolerance: 0 for exact caps; > 0 lets a rank be loaded up to floor((1 + tolerance) * cap),
            which moves fewer tokens with fewer copies.
        ranks_per_node: if given, a node's surplus goes to its own ranks first ("match": matched
            inside the node first; "device": both lines ordered node by node).
        validate: check tpe on the host first (syncs; the errors name the bad value). A runtime that
            counted tpe itself from checked ids may pass False: with tokens_per_rank given and strategy
            "device", plan() then never syncs.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance}")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if validate:
        S = _check(tpe, top_k, tokens_per_rank, total_tokens, token_padding)
    else:
        S = int(tpe.sum(1).max()) // top_k if tokens_per_rank is None else tokens_per_rank
    rows_cap = S * top_k + int(S * top_k * tolerance)  # >= every rank's limit, as cap <= S*K
    epn = Homes(tpe.shape[1], tpe.shape[0]).epn
    buffer_rows = _align_up(rows_cap + (token_padding - 1) * 2 * epn, token_padding)
    tpe = tpe.long()
    if strategy == "device":
        t, used = device_plan(tpe, top_k, token_padding, tolerance, ranks_per_node), strategy
    else:
        cap, limit = _caps(tpe, tolerance)
        alloc, used = host_alloc(tpe.sum(0), cap, limit, strategy, tolerance == 0, ranks_per_node)
        t = PlanTensors(cap, limit, alloc, *_layout(tpe, alloc, token_padding))
    return Plan(cap=t.cap, limit=t.limit, alloc=t.alloc, replicas=t.replicas, cu_seqlens=t.cu_seqlens,
                buffer_rows=buffer_rows, tpe=tpe, top_k=top_k, strategy=used,
                _src_start=t.src_start, _run_end=t.run_end, _row_shift=t.row_shift)


def device_plan(
    tpe: torch.Tensor, top_k: int, token_padding: int = 1, tolerance: float = 0.0, ranks_per_node: int | None = None
) -> PlanTensors:
    """The "device" plan's tensors from an int64 `[R, E]` tpe, unchecked: a fixed-shape tensor program
    with no host sync (what `plan` runs after its checks; compile it with
    `torch.compile(device_plan, fullgraph=True, dynamic=False)`)."""
    cap, limit = _caps(tpe, tolerance)
    R, E = tpe.shape
    alloc = device_alloc(tpe.sum(0), cap, limit, Homes(E, R), ranks_per_node)
    return PlanTensors(cap, limit, alloc, *_layout(tpe, alloc, token_padding))


def device_step(
    tpe: torch.Tensor, topk_ids: torch.Tensor, rank: int, top_k: int, token_padding: int = 1,
    tolerance: float = 0.0, ranks_per_node: int | None = None,
) -> tuple[PlanTensors, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the runtime plans per step on one rank, sync-free: (the plan's tensors, dst_rank `[s, K]`,
    dst_row `[s, K]`, send counts `[R]`, receive counts `[R]`), as `device_plan` then
    `Plan.slots(check=False)` and `traffic_of`. One program to compile or capture."""
    t = device_plan(tpe, top_k, token_padding, tolerance, ranks_per_node)
    dst, row = slot_map(t.src_start[rank], t.run_end, t.row_shift, topk_ids)
    send, recv = traffic_of(tpe, t.alloc, t.src_start, t.run_end, rank)
    return t, dst, row, send, recv


def _caps(tpe: torch.Tensor, tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cap `[R]`, limit `[R]`) on tpe's device."""
    R = tpe.shape[0]
    slots = tpe.sum()
    cap = slots // R + (torch.arange(R, device=tpe.device) < slots % R).long()
    return cap, cap + (cap.double() * tolerance).floor().long()


def _layout(tpe: torch.Tensor, alloc: torch.Tensor, token_padding: int) -> tuple[torch.Tensor, ...]:
    """(replicas, cu_seqlens, src_start, run_end, row_shift) from alloc: fixed-shape, no sync."""
    R, E = tpe.shape
    homes = Homes(E, R)
    epn = homes.epn
    dev = tpe.device
    experts = torch.arange(E, device=dev)
    home, local = homes.rank_of(experts), homes.local(experts)
    remote = alloc.index_put((experts, home), torch.zeros_like(experts))
    # Replica slots: each rank's remote experts in ascending id; column epn catches nothing real. The
    # cumsums run along contiguous rows (along a strided dim aten's CPU cumsum is ~7x slower).
    mask = (remote > 0).t().contiguous()  # [R, E]
    slot = mask.long().cumsum(1) - 1
    replicas = torch.full((R, epn + 1), -1, dtype=torch.long, device=dev)
    replicas.scatter_(1, torch.where(mask, slot.clamp(max=epn), epn), torch.where(mask, experts.expand(R, E), -1))
    replicas = replicas[:, :epn].contiguous()
    padded_alloc = torch.cat([alloc, alloc.new_zeros(1, R)])  # row E: empty home / replica slots
    ranks = torch.arange(R, device=dev).view(R, 1)
    home_groups = padded_alloc[homes.slots(dev), ranks]
    groups = torch.cat([home_groups, padded_alloc[replicas.where(replicas >= 0, E), ranks]], 1)
    padded = _align_up(groups, token_padding)
    cu_seqlens = padded.cumsum(1)
    group_start = cu_seqlens - padded
    group = torch.where(mask, epn + slot.clamp(0, epn - 1), local.view(1, E))  # [R, E] e's group on r
    row_start = group_start.gather(1, group).t()
    load = alloc.sum(1)
    expert_base = load.cumsum(0) - load
    run_end = expert_base.view(E, 1) + alloc.cumsum(1)
    before = tpe.t().contiguous().cumsum(1).t() - tpe  # [R, E] pairs of e on the ranks before r
    return (replicas, cu_seqlens, expert_base.view(1, E) + before, run_end.reshape(-1),
            (run_end - alloc - row_start).reshape(-1))
