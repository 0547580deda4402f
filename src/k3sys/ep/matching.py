"""Which home group sends how many pairs to which rank: the two host planner strategies (`host_alloc`).

Both see R numbers (each home group's load against its limit), so they run as plain Python over at
most a few R matching rounds after one small device-to-host copy. They return quotas[h] = {d: pairs}
(home group h sends pairs to rank d); `cut_quotas` then turns quotas into (expert, rank, pairs).

- `greedy_quotas`, the published MoonEP policy: fill the roomiest rank completely from the most
  over-loaded group, even past that group's own surplus (it then becomes a rank with room). Every
  rank takes one quota from one group, so it needs at most epn replica slots.
- `match_quotas`, ours: repeatedly take the largest surplus and the largest room and move
  min(surplus, room). A group never sends more than its surplus, so moved pairs meet the lower
  bound sum_h max(0, load_h - limit_h). Copies: a plan over n sending groups and m receiving ranks
  has n + m - c pieces, where c counts the sets of groups and ranks whose surpluses and rooms sum to
  the same total, so the loop closes sides together where it can: before the largest-with-largest
  move it looks for a partner of exactly the same size, then for two partners summing to it. The
  leftovers shrink as in the differencing heuristic for number partitioning, so late rounds often
  close both sides at once. When a rank's last replica slot would leave it short, the group
  overshoots instead (fills it, as the greedy does), which keeps every rank within epn slots.
"""

from __future__ import annotations

import heapq
from collections import Counter

import torch

from k3sys.ep.homes import Homes

Quotas = list[dict[int, int]]


class _Side:
    """Positive amounts by id: the largest (ties to the lowest id) and exact-amount lookup."""

    def __init__(self, amounts: dict[int, int]) -> None:
        self.now: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []
        self.by_amount: dict[int, set[int]] = {}
        for i, a in amounts.items():
            self.set(i, a)

    def __bool__(self) -> bool:
        return bool(self.now)

    def largest(self) -> tuple[int, int]:
        while True:  # entries whose amount changed since they were pushed are stale
            a, i = self.heap[0]
            if self.now.get(i) == -a:
                return i, -a
            heapq.heappop(self.heap)

    def exact(self, a: int, other_than: int = -1) -> int | None:
        ids = self.by_amount.get(a)
        if not ids or ids == {other_than}:
            return None
        return min(ids) if other_than not in ids else min(j for j in ids if j != other_than)

    def pair(self, total: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Two ids whose amounts sum to `total` (the first found in a fixed order), or None."""
        by_amount = self.by_amount
        for i, a in self.now.items():
            ids = by_amount.get(total - a)
            if ids and ids != {i}:
                return (i, a), (self.exact(total - a, other_than=i), total - a)
        return None

    def set(self, i: int, a: int) -> None:
        old = self.now.pop(i, None)
        if old is not None:
            self.by_amount[old].discard(i)
        if a > 0:
            self.now[i] = a
            heapq.heappush(self.heap, (-a, i))
            self.by_amount.setdefault(a, set()).add(i)


def greedy_quotas(group_load: list[int], cap: list[int]) -> Quotas:
    """MoonEP's greedy: at most R fills of the roomiest rank from the most over-loaded group."""
    R = len(cap)
    balance = [g - c for g, c in zip(group_load, cap, strict=True)]
    quotas: Quotas = [{} for _ in range(R)]
    for _ in range(R):
        h = max(range(R), key=balance.__getitem__)
        if balance[h] <= 0:
            break
        d = min(range(R), key=balance.__getitem__)
        quotas[h][d] = -balance[d]
        balance[h] += balance[d]
        balance[d] = 0
    return quotas


class _Matching:
    """State shared by the matching phases: what each group still sends, each rank still takes."""

    def __init__(self, group_load: list[int], limit: list[int], epn: int, exact: bool) -> None:
        self.surplus = [max(0, g - c) for g, c in zip(group_load, limit, strict=True)]
        self.room = [max(0, c - g) for g, c in zip(group_load, limit, strict=True)]
        self.home_left = list(group_load)
        self.slots = [epn] * len(limit)
        self.exact = exact
        self.quotas: Quotas = [{} for _ in limit]

    def run(self, ranks: range, last: bool) -> bool:
        """Match the groups and ranks in `ranks`; the `last` phase must place every surplus (False if
        it cannot within the slots), an earlier one leaves what it cannot place to the next."""
        src = _Side({h: self.surplus[h] for h in ranks})
        dst = _Side({d: self.room[d] for d in ranks})
        slots = self.slots

        def send(h: int, a: int, d: int, b: int, n: int) -> None:
            """Group h (surplus a) sends n pairs to rank d (room b); a rank out of slots takes no more."""
            self.surplus[h] = a - n
            self.room[d] = b - n if slots[d] > 1 else 0
            src.set(h, self.surplus[h])
            dst.set(d, self.room[d])
            self.quotas[h][d] = self.quotas[h].get(d, 0) + n
            self.home_left[h] -= n
            slots[d] -= 1

        while src:
            if not dst:
                return not last
            h, a = src.largest()
            d, b = dst.largest()
            if a == b:
                send(h, a, d, b, a)
            elif (same := dst.exact(a)) is not None:
                send(h, a, same, a, a)
            elif (same := src.exact(b)) is not None:
                send(same, b, d, b, b)
            elif two := dst.pair(a):  # one group closes two ranks
                (d1, b1), (d2, b2) = two
                send(h, a, d1, b1, b1)
                send(h, a - b1, d2, b2, b2)
            elif slots[d] >= 2 and (two := src.pair(b)):  # two groups close one rank
                (h1, a1), (h2, a2) = two
                send(h1, a1, d, b, a1)
                send(h2, a2, d, b - a1, a2)
            elif self.exact and slots[d] == 1 and a < b:
                if not last:
                    dst.set(d, 0)  # keep d's last slot for the phase that must close it
                    continue
                # d's last slot must close it: h sends all of b and is left with room of its own.
                if self.home_left[h] < b:
                    return False
                send(h, a, d, b, b)
                self.room[h] = b - a
                dst.set(h, b - a)
            else:
                send(h, a, d, b, min(a, b))
        return True


def match_quotas(
    group_load: list[int], limit: list[int], epn: int, exact: bool, ranks_per_node: int | None = None
) -> Quotas | None:
    """Ours (see the module doc). `exact`: every rank must end at its limit (tolerance 0).

    With `ranks_per_node`, each node's groups are matched with its own ranks first and only the rest
    crosses nodes (replica weights then mostly travel over NVLink). Returns None when the surplus does
    not fit into epn replica slots per rank (the caller then falls back to the greedy, which always can).
    """
    R = len(limit)
    m = _Matching(group_load, limit, epn, exact)
    if ranks_per_node and ranks_per_node < R:
        for start in range(0, R, ranks_per_node):
            m.run(range(start, min(R, start + ranks_per_node)), last=False)
    return m.quotas if m.run(range(R), last=True) else None


def cut_quotas(quotas: Quotas, expert_load: list[list[int]]) -> list[tuple[int, int, int]]:
    """(expert, rank, pairs) pieces: each group's quotas, largest first, cut from its largest remaining
    expert (MoonEP's rule; an expert that covers a quota gives one piece). `expert_load[h]` lists group
    h's experts in id order; groups may differ in size (uneven homes)."""
    first = [0]
    for loads in expert_load:
        first.append(first[-1] + len(loads))
    pieces = []
    for h, quota in enumerate(quotas):
        left = list(expert_load[h])
        for d, q in sorted(quota.items(), key=lambda dq: (-dq[1], dq[0])):
            while q > 0:
                i = max(range(len(left)), key=left.__getitem__)
                n = min(q, left[i])
                if n == 0:
                    raise AssertionError(f"group {h}'s quotas exceed its load {expert_load[h]}")
                pieces.append((first[h] + i, d, n))
                left[i] -= n
                q -= n
    return pieces


def host_alloc(
    load: torch.Tensor, cap: torch.Tensor, limit: torch.Tensor, strategy: str, exact: bool, ranks_per_node: int | None
) -> tuple[torch.Tensor, str]:
    """The host strategies ("match", "greedy"): alloc `[E, R]` from `[E]` expert loads, and the strategy
    that produced it (syncs: R-sized host loops)."""
    R, E = cap.numel(), load.numel()
    homes = Homes(E, R)
    loads = load.tolist()
    expert_load = [loads[homes.start(r) : homes.start(r + 1)] for r in range(R)]
    group_load = [sum(g) for g in expert_load]
    pieces = None
    # A tolerance so small that it leaves almost no slack can make the inexact match run out of
    # room; the exact match then still beats the greedy fallback.
    attempts = [(limit, exact)] + ([] if exact else [(cap, True)])
    while strategy == "match" and pieces is None and attempts:
        bound, exact_caps = attempts.pop(0)
        quotas = match_quotas(group_load, bound.tolist(), homes.epn, exact_caps, ranks_per_node)
        pieces = None if quotas is None else cut_quotas(quotas, expert_load)
        if pieces and max(Counter(d for _, d, _ in pieces).values()) > homes.epn:
            pieces = None  # a quota split over several experts overfilled a rank's slots
    used = strategy if pieces is not None else "greedy"
    if pieces is None:
        pieces = cut_quotas(greedy_quotas(group_load, cap.tolist()), expert_load)
    e, d, n = torch.tensor(pieces, dtype=torch.long, device=load.device).view(-1, 3).unbind(1)
    alloc = torch.zeros(E, R, dtype=torch.long, device=load.device)
    experts = torch.arange(E, device=load.device)
    alloc[experts, homes.rank_of(experts)] = load - torch.zeros_like(load).index_add_(0, e, n)
    alloc.view(-1).index_add_(0, e * R + d, n)
    return alloc, used
