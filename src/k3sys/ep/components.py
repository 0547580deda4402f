"""Exact components for the device planner's line match: small sets of senders and receivers whose
surpluses and rooms have the same total.

A plan over n sending groups and m receiving ranks makes at least n + m - c pieces, c the number of
disjoint subsets closing on both sides at once (docs/ep.md). The line match reaches that only where
its two prefix sums meet, so a component laid out first, at the same place on both lines, saves one
piece. Random loads rarely have equal pairs, but among R^2 pair sums a surplus often finds its
exact partners; MoonEP's greedy gets its copies down the same way, by chance, on the small
remainders its overshoots leave late in its fills.

Fixed-shape tensor code like the rest of the planner: each shape (a senders : b receivers) is one
enumeration of index combinations (sizes from R only), one sort, one searchsorted; overlapping
finds are settled without a loop (an item belongs to the first find that wants it; a find keeps
only if it owns all its items), deterministic on every rank.
"""

from __future__ import annotations

import itertools
import math

import torch

__all__ = ["components_first"]

# (senders, receivers) per component, fewer items first (more components fit), up to 6 items. The
# pair shapes are always tried (R^2 / 2 sums: enough at R >= 128 to use fewer copies than the
# greedy, docs/ep.md "Copies"); a larger one where its enumerations hold at most BUDGET
# combinations (the small R, where a few more found components decide against the greedy).
SHAPES = tuple(sorted(((a, n - a) for n in range(3, 7) for a in range(1, n)), key=lambda s: (sum(s), s)))
BUDGET = 5_000


def _tried(num_ranks: int, a: int, b: int) -> bool:
    """Whether the shape a : b is searched at R = num_ranks (static: from R only)."""
    return max(a, b) <= num_ranks and (a + b == 3 or max(math.comb(num_ranks, a), math.comb(num_ranks, b)) <= BUDGET)
_COMBOS: dict[tuple[int, int, str], torch.Tensor] = {}


def _combos(n: int, k: int, device: torch.device) -> torch.Tensor:
    """All k-subsets of range(n) `[C, k]` in lexicographic order. Built from n and k alone, on the
    host (`torch.combinations` selects by a mask, which syncs on a GPU), and kept per device."""
    key = (n, k, str(device))
    if key not in _COMBOS:
        _COMBOS[key] = torch.tensor(list(itertools.combinations(range(n), k)), dtype=torch.long,
                                    device=device).view(-1, k)
    return _COMBOS[key]


def _find(left: torch.Tensor, left_free: torch.Tensor, right: torch.Tensor, right_free: torch.Tensor,
          a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Disjoint components of `a` free items of `left` `[R]` summing to `b` free items of `right`:
    (kept `[C]`, left items `[C, a]`, right items `[C, b]`), one row per left combination."""
    R, device = left.numel(), left.device
    lc, rc = _combos(R, a, device), _combos(R, b, device)
    want = torch.where(left_free[lc].all(1), left[lc].sum(1), -2)
    have = torch.where(right_free[rc].all(1), right[rc].sum(1), -1)
    order = torch.sort(have, stable=True).indices
    have_sorted = have[order]
    at = torch.searchsorted(have_sorted, want).clamp(max=have.numel() - 1)
    hit = have_sorted[at] == want
    partner = rc[order[at]]
    C = lc.shape[0]
    find = torch.where(hit, torch.arange(C, device=device), C)

    def owners(items: torch.Tensor, k: int) -> torch.Tensor:
        """`[R]` the first find wanting each item (C: none)."""
        return torch.full((R,), C, dtype=torch.long, device=device).scatter_reduce(
            0, items.reshape(-1), find.repeat_interleave(k), "amin")

    mine = find.view(-1, 1)
    kept = hit & (owners(lc, a)[lc] == mine).all(1) & (owners(partner, b)[partner] == mine).all(1)
    return kept, lc, partner


def components_first(surplus: torch.Tensor, room: torch.Tensor, sender_order: torch.Tensor,
                     receiver_order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sender order, receiver order) `[R]`: the orders given (which start with their 1:1 matches,
    surplus == room, position by position) with the components of SHAPES found among the rest placed
    right after those, component by component at the same place on both lines, then the rest by
    amount descending."""
    R, device = surplus.numel(), surplus.device
    pos = torch.arange(R, device=device)
    paired = torch.cumprod(((surplus[sender_order] == room[receiver_order]) & (surplus[sender_order] > 0)).long(),
                           0).bool()
    none = 1 << 40  # past every component's key
    # Keys: 8 per component (room for its items in line order); the 1:1 matches keep their places.
    # One extra entry takes the writes of the finds not kept (a masked index would sync).
    s_key = surplus.new_full((R + 1,), none).index_put_((sender_order,), torch.where(paired, pos * 8, none))
    r_key = room.new_full((R + 1,), none).index_put_((receiver_order,), torch.where(paired, pos * 8, none))
    base = R * 8
    for a, b in SHAPES:
        if not _tried(R, a, b):
            continue
        kept, s_items, r_items = _find(surplus, (s_key[:R] == none) & (surplus > 0), room,
                                       (r_key[:R] == none) & (room > 0), a, b)
        key = base + torch.arange(kept.numel(), device=device).view(-1, 1) * 8
        at = kept.view(-1, 1)
        s_key.index_put_((torch.where(at, s_items, R).view(-1),), (key + torch.arange(a, device=device)).view(-1))
        r_key.index_put_((torch.where(at, r_items, R).view(-1),), (key + torch.arange(b, device=device)).view(-1))
        base += kept.numel() * 8
    s_key, r_key = s_key[:R], r_key[:R]
    # The rest: by amount descending (ties in index order, the stable sort), after every component.
    s_key = torch.where(s_key == none, 2 * none - surplus, s_key)
    r_key = torch.where(r_key == none, 2 * none - room, r_key)
    return torch.sort(s_key, stable=True).indices, torch.sort(r_key, stable=True).indices
