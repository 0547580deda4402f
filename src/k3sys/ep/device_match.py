"""The device planner's placement: alloc `[E, R]` from expert loads as one fixed-shape tensor program.

No host sync, no data-dependent shape, no Python loop over ranks, experts or pieces: sorts, cumsums,
searchsorted and scatters over tensors whose sizes depend on R and E only, so it runs where the
counts are (the GPU) and captures in a CUDA graph / compiles with `torch.compile(fullgraph=True)`.

Three matchings of surplus to room by overlapping prefix sums, all computed, the first that fits
kept (`torch.where`, no branch):

1. The line match. Every over-limit home group lays its surplus out over its experts, largest first
   (an expert that covers the rest gives one piece), groups by surplus descending: the sender line.
   Under-limit ranks lay out their room, largest first: the receiver line. A piece is a stretch
   where one expert's segment overlaps one rank's room, so every group sends exactly its surplus
   (moved = the lower bound) and there are at most (segments + receivers - 1) pieces, each a
   distinct (expert, rank) copy. Two cheap coincidences save pieces: a surplus equal to some room
   goes first on both lines, and the cut before a group's last expert slides onto a receiver
   boundary where both experts allow it. It does not fit when a receiver meets the tails of more
   groups than its epn replica slots hold.
2. The chain's rounding where (1) overfills: sender j's surplus ends at U_j (the prefix sum) on the
   receiver line; if that is inside an overfilled receiver, it rounds up to the receiver's end T_j
   (searchsorted) and overshoots by v_j = T_j - U_j, which sender j + 1 sends back to rank j before
   it goes on. Unrolling the sequential recurrence gives T_j - v_j = U_j for every j, so all of it
   is closed-form. The overfilled receiver now takes one group only; the moved pairs grow by the few
   overshoots.
3. The chain everywhere, at exact caps: every rank takes pieces of one home group only (at most epn
   experts), as in MoonEP's greedy, so it always fits (v_j is below a receiver's room, so at most
   cap_j, which the group's home covers), at the price of moving every overshoot twice.
"""

from __future__ import annotations

import torch

from k3sys.ep.homes import Homes

__all__ = ["device_alloc"]


def _desc(x: torch.Tensor) -> torch.Tensor:
    """Stable order of `x` [R] descending (ties to the lower index): deterministic on every rank."""
    return torch.sort(x, descending=True, stable=True).indices


def _equal_first(surplus: torch.Tensor, room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sender order, receiver order) `[R]`: every surplus equal to some room (one to one) first, both
    sides in the same order, so each such pair meets in one piece; the rest by amount descending."""
    R = surplus.numel()

    def keys(x: torch.Tensor) -> torch.Tensor:
        order = torch.sort(x, stable=True).indices
        xs = x[order]
        occurrence = torch.arange(R, device=x.device) - torch.searchsorted(xs, xs)  # among equal amounts
        key = torch.empty_like(x).index_put_((order,), xs * (R + 1) + occurrence)
        return torch.where(x > 0, key, -1)  # (amount, occurrence), -1 for nothing to match

    ks, kr = keys(surplus), keys(room)
    ks_sorted, kr_sorted = torch.sort(ks).values, torch.sort(kr).values
    found_s = kr_sorted[torch.searchsorted(kr_sorted, ks).clamp(max=R - 1)] == ks
    found_r = ks_sorted[torch.searchsorted(ks_sorted, kr).clamp(max=R - 1)] == kr

    def order(x: torch.Tensor, key: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        by_value = torch.sort(torch.where(found & (key >= 0), key, -1 - x), stable=True).indices
        return by_value[torch.sort((~(found & (key >= 0)))[by_value].long(), stable=True).indices]

    return order(surplus, ks, found_s), order(room, kr, found_r)


def _node_major(order: torch.Tensor, ranks_per_node: int | None) -> torch.Tensor:
    """`order` regrouped node by node (keeping its order inside a node)."""
    if ranks_per_node is None:
        return order
    return order[torch.sort(order // ranks_per_node, stable=True).indices]


def _sender_line(
    g_rp: torch.Tensor, ids_rp: torch.Tensor, sent_r: torch.Tensor, order_r: torch.Tensor, recv_end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment pairs `[R * epn]`, segment expert `[R * epn]`): groups in `order_r`, each group's `sent`
    pairs cut from its experts largest first, the cut before its last (partial) expert moved down onto
    a receiver boundary (`recv_end`, the receivers' line ends) when one lies where both experts still
    cover their share: the piece that would straddle that boundary then never exists."""
    g_sorted, idx = torch.sort(g_rp[order_r], dim=1, descending=True, stable=True)
    cum = g_sorted.cumsum(1)
    sent = sent_r[order_r].view(-1, 1)
    amount = (torch.minimum(cum, sent) - (cum - g_sorted)).clamp(min=0)  # [R, epn], line order
    start = sent.view(-1).cumsum(0) - sent.view(-1)
    j = ((amount > 0).sum(1, keepdim=True) - 2).clamp(min=0)  # the expert before the last one used
    full_j, full_next = g_sorted.gather(1, j), g_sorted.gather(1, (j + 1).clamp(max=g_rp.shape[1] - 1))
    upper = start.view(-1, 1) + cum.gather(1, j)  # the cut's place; it may move down to lower
    lower = torch.maximum(start.view(-1, 1) + sent - full_next, upper - full_j)
    bounds = torch.cat([recv_end.new_zeros(1), recv_end])
    b = bounds[torch.searchsorted(bounds, upper, right=True) - 1]
    shift = torch.where((j + 2 <= (amount > 0).sum(1, keepdim=True)) & (b >= lower), upper - b, 0)
    amount = amount.scatter_add(1, j, -shift).scatter_add(1, (j + 1).clamp(max=g_rp.shape[1] - 1), shift)
    return amount.reshape(-1), ids_rp[order_r].gather(1, idx).reshape(-1)


def _overlap(
    seg_n: torch.Tensor, seg_expert: torch.Tensor, recv_n: torch.Tensor, recv_rank: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, rank, pairs) `[N + M]` of every stretch where a sender segment overlaps a receiver's
    room; pieces past the end of either line get 0 pairs (the static piece count is N + M)."""
    seg_end, recv_end = seg_n.cumsum(0), recv_n.cumsum(0)
    cuts = torch.sort(torch.cat([seg_end, recv_end])).values
    start = torch.cat([cuts.new_zeros(1), cuts[:-1]])
    seg = torch.searchsorted(seg_end, start, right=True).clamp(max=seg_n.numel() - 1)
    rcv = torch.searchsorted(recv_end, start, right=True).clamp(max=recv_n.numel() - 1)
    live = start < torch.minimum(seg_end[-1], recv_end[-1])
    return seg_expert[seg], recv_rank[rcv], torch.where(live, cuts - start, 0)


def _chain(
    surplus_r: torch.Tensor, room_r: torch.Tensor, senders: torch.Tensor, receivers: torch.Tensor,
    round_up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain's (pairs each group sends `[R]`, receiver line sizes `[2R]`, receiver line ranks
    `[2R]`) for groups in `senders` order and ranks in `receivers` order; sender j rounds its end up
    to the next receiver boundary where `round_up[j]`, and its overshoot becomes a room of rank j right
    where sender j + 1 starts (an overshoot of 0 elsewhere: there the line match is unchanged)."""
    R = surplus_r.numel()
    u = surplus_r[senders].cumsum(0)
    bounds = torch.cat([u.new_zeros(1), room_r[receivers].cumsum(0)])  # [R + 1]
    t = torch.where(round_up, bounds[torch.searchsorted(bounds, u).clamp(max=R)], u)
    over = t - u  # v_j, paid back by sender j + 1
    filler = torch.searchsorted(t, bounds[:-1], right=True)  # the first sender whose stretch holds receiver i
    pos = torch.arange(R, device=u.device)
    line = torch.sort(torch.cat([filler * (R + 1) + 1 + pos, (pos + 1) * (R + 1)])).indices
    sizes = torch.cat([room_r[receivers], over])[line]
    ranks = torch.cat([receivers, senders])[line]
    return surplus_r + torch.zeros_like(over).index_put_((senders,), over), sizes, ranks


def _alloc(load_e: torch.Tensor, homes: Homes, expert: torch.Tensor, rank: torch.Tensor, n: torch.Tensor) -> (
    torch.Tensor
):
    """alloc `[E, R]`: every pair at home, minus the pieces (expert, rank, n) moved away."""
    R, E = homes.num_ranks, homes.num_experts
    experts = torch.arange(E, device=load_e.device)
    home = homes.rank_of(experts)
    flat = torch.zeros((E + 1) * R, dtype=torch.long, device=load_e.device)  # row E: empty home slots
    flat.index_put_((experts * R + home,), load_e)
    flat.index_add_(0, expert * R + rank, n)
    flat.index_add_(0, expert * R + homes.rank_of(expert).clamp(max=R - 1), -n)
    return flat.view(E + 1, R)[:E]


def _replicas(rank: torch.Tensor, n: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """`[R]` copies each rank takes from pieces (expert, rank, n) (every live piece is a distinct copy)."""
    return torch.zeros(num_ranks, dtype=torch.long, device=n.device).index_add_(0, rank, (n > 0).long())


def device_alloc(
    load_e: torch.Tensor, cap_r: torch.Tensor, limit_r: torch.Tensor, homes: Homes, ranks_per_node: int | None = None
) -> torch.Tensor:
    """alloc `[E, R]` int64: pairs of expert e processed on rank r, every rank within its limit (exactly its
    cap when limit == cap), at most epn replicas per rank.

    Three candidates, the first that fits kept: the line match; the line match with the chain's
    rounding only for the senders that end inside a receiver the line match overfills (moves a little
    more); the chain at exact caps (always fits). `ranks_per_node` orders both lines node by node, so a
    node's surplus meets its own ranks' room first (where the node's totals allow it)."""
    R, epn = homes.num_ranks, homes.epn
    ids_rp = homes.slots(load_e.device)
    g_rp = torch.cat([load_e, load_e.new_zeros(1)])[ids_rp]
    group = g_rp.sum(1)

    surplus, room = (group - limit_r).clamp(min=0), (limit_r - group).clamp(min=0)
    senders, receivers = (_node_major(o, ranks_per_node) for o in _equal_first(surplus, room))
    recv_end = room[receivers].cumsum(0)
    line = _overlap(*_sender_line(g_rp, ids_rp, surplus, senders, recv_end), room[receivers], receivers)
    crowded = _replicas(line[1], line[2], R) > epn

    u = surplus[senders].cumsum(0)
    inside = torch.searchsorted(recv_end, u, right=True).clamp(max=R - 1)  # the receiver holding u_j
    strictly = u > torch.cat([recv_end.new_zeros(1), recv_end])[inside]
    sent, sizes, ranks = _chain(surplus, room, senders, receivers, strictly & crowded[receivers[inside]])
    mended = _overlap(*_sender_line(g_rp, ids_rp, sent, senders, sizes.cumsum(0)), sizes, ranks)
    mended_fits = (_replicas(mended[1], mended[2], R) <= epn).all() & (sent <= group).all()

    surplus, room = (group - cap_r).clamp(min=0), (cap_r - group).clamp(min=0)
    senders, receivers = _desc(surplus), _desc(room)
    sent, sizes, ranks = _chain(surplus, room, senders, receivers, torch.ones_like(senders, dtype=torch.bool))
    chain = _overlap(*_sender_line(g_rp, ids_rp, sent, senders, sizes.cumsum(0)), sizes, ranks)

    pad = chain[0].numel() - line[0].numel()  # the line has R fewer receiver items
    line = tuple(torch.cat([x, x.new_zeros(pad)]) for x in line)
    choice = torch.where(~crowded.any(), 0, torch.where(mended_fits, 1, 2))
    # index_select, not [choice]: indexing with a 0-d tensor reads it on the host
    e, d, n = (torch.stack(c).index_select(0, choice.view(1))[0] for c in zip(line, mended, chain, strict=True))
    return _alloc(load_e, homes, e, d, n)
