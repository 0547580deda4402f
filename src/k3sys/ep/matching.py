"""Which home group sends how many pairs to which rank: the two planner strategies, on the host.

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
        ids = self.by_amount.get(a, set()) - {other_than}
        return min(ids) if ids else None

    def pair(self, total: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Two ids whose amounts sum to `total` (the first found in a fixed order), or None."""
        for i, a in self.now.items():
            if a < total and (j := self.exact(total - a, other_than=i)) is not None:
                return (i, a), (j, total - a)
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


def match_quotas(group_load: list[int], limit: list[int], epn: int, exact: bool) -> Quotas | None:
    """Ours (see the module doc). `exact`: every rank must end at its limit (tolerance 0).

    Returns None when it cannot place the surplus within epn replica slots per rank (the caller then
    falls back to the greedy, which always can).
    """
    R = len(limit)
    src = _Side({h: g - c for h, (g, c) in enumerate(zip(group_load, limit, strict=True))})
    dst = _Side({d: c - g for d, (g, c) in enumerate(zip(group_load, limit, strict=True))})
    home_left = list(group_load)
    slots = [epn] * R
    quotas: Quotas = [{} for _ in range(R)]

    def send(h: int, a: int, d: int, b: int, n: int) -> None:
        """Group h (surplus a) sends n pairs to rank d (room b); a rank out of slots takes no more."""
        src.set(h, a - n)
        dst.set(d, b - n if slots[d] > 1 else 0)
        quotas[h][d] = quotas[h].get(d, 0) + n
        home_left[h] -= n
        slots[d] -= 1

    while src:
        if not dst:
            return None
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
        elif exact and slots[d] == 1 and a < b:
            # d's last slot must close it: h sends all of b and is left with room of its own.
            if home_left[h] < b:
                return None
            send(h, a, d, b, b)
            dst.set(h, b - a)
        else:
            send(h, a, d, b, min(a, b))
    return quotas


def cut_quotas(quotas: Quotas, expert_load: list[list[int]]) -> list[tuple[int, int, int]]:
    """(expert, rank, pairs) pieces: each group's quotas, largest first, cut from its largest remaining
    expert (MoonEP's rule; an expert that covers a quota gives one piece)."""
    epn = len(expert_load[0]) if expert_load else 0
    pieces = []
    for h, quota in enumerate(quotas):
        left = list(expert_load[h])
        for d, q in sorted(quota.items(), key=lambda dq: (-dq[1], dq[0])):
            while q > 0:
                i = max(range(epn), key=left.__getitem__)
                n = min(q, left[i])
                if n == 0:
                    raise AssertionError(f"group {h}'s quotas exceed its load {expert_load[h]}")
                pieces.append((h * epn + i, d, n))
                left[i] -= n
                q -= n
    return pieces
