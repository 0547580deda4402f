"""The device planner's placement: alloc `[E, R]` from expert loads as one fixed-shape tensor program.

No host sync, no data-dependent shape, no Python loop over ranks, experts or pieces: sorts, cumsums,
searchsorted and scatters over tensors whose sizes depend on R and E only (the loops below run a
static number of rounds), so it runs where the counts are (the GPU) and captures in a CUDA graph /
compiles with `torch.compile(fullgraph=True)`.

Several matchings of surplus to room, all computed, the fit one that moves the fewest pairs (then
makes the fewest pieces) kept (`torch.argmin` over their keys, no branch):

1. The line match. Over-limit home groups lay their surplus out end to end, groups by surplus
   descending: the sender line. Under-limit ranks lay out their room, largest first: the receiver
   line. A piece is a stretch where one expert's segment overlaps one rank's room, so every group
   sends exactly its surplus (moved = the lower bound). Coincidences save pieces: a surplus equal
   to some room goes first on both lines; a group whose stretch meets at most epn receivers, each
   quota no larger than a distinct expert, sends each quota from its own expert (one piece per
   receiver, as MoonEP's greedy cuts them); otherwise the cut before a group's last expert slides
   onto a receiver boundary where both experts allow it. It does not fit when a receiver meets more
   pieces than its epn replica slots hold (a *crowded* receiver).
2. Mended: the chain's snapping only where (1) crowds a receiver. Sender j's end U_j (the prefix
   sum) moves onto a receiver boundary T (searchsorted): up, and sender j + 1 pays the overshoot
   back to rank j, or down, and rank j + 1 (a sender, so its slots are free) takes the pairs past
   T and sends them on; the nearer one. Unrolling that sequential recurrence leaves every end on
   its boundary, so all of it is closed-form. Either every sender ending inside a crowded receiver
   snaps (it then meets one group), or only the ones straddling into it (it meets one fewer).
3. Anchored: a crowded receiver cannot be filled by many small surpluses, and passing the overflow
   from rank to rank (the chain; MoonEP's greedy does the same) moves it again at every hop. Instead
   it takes one whole piece from each of a block of the largest senders, as many as its slots: each
   anchor's surplus plus, where those fall short of the room, more of its largest expert, spread
   evenly so the overshoots are rooms the remaining senders fill in few pieces. Then (1)-(2) on what
   is left, and again, ceil(log_epn R) rounds: the relays form a tree of fan-in epn, which is the
   least any plan can move when the slots force relays (docs/ep.md, "Designed inputs").
4. The chain at exact caps: every sender snaps up, so every rank takes pieces of one home group only
   (at most epn experts), as in MoonEP's greedy: always fits (v_j is below a receiver's room, so at
   most cap_j, which the group's home covers), at the price of moving every overshoot twice.
"""

from __future__ import annotations

import torch

from k3sys.ep.components import components_first
from k3sys.ep.homes import Homes

__all__ = ["device_alloc"]


def _desc(x: torch.Tensor) -> torch.Tensor:
    """Stable order of `x` [R] descending (ties to the lower index): deterministic on every rank."""
    return torch.sort(x, descending=True, stable=True).indices


def _equal_first(surplus: torch.Tensor, room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sender order, receiver order) `[R]`: every surplus equal to some room (one to one) first, both
    sides in the same order, so each such pair meets in one piece; the rest by amount descending."""
    R = surplus.numel()

    def keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key `[R]`, the keys ascending `[R]`): (amount, occurrence among equal amounts), -1 for
        nothing to match. The keys rise along x's ascending order, so that order sorts them too."""
        order = torch.sort(x, stable=True).indices
        xs = x[order]
        occurrence = torch.arange(R, device=x.device) - torch.searchsorted(xs, xs)  # among equal amounts
        ascending = torch.where(xs > 0, xs * (R + 1) + occurrence, -1)
        return torch.empty_like(x).index_put_((order,), ascending), ascending

    (ks, ks_sorted), (kr, kr_sorted) = keys(surplus), keys(room)
    found_s = (kr_sorted[torch.searchsorted(kr_sorted, ks).clamp(max=R - 1)] == ks) & (ks >= 0)
    found_r = (ks_sorted[torch.searchsorted(ks_sorted, kr).clamp(max=R - 1)] == kr) & (kr >= 0)

    def order(x: torch.Tensor, key: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        # One stable sort: the matched ones by key (< 2^62 - x for any real amount), then the rest by
        # amount descending, ties in index order.
        return torch.sort(torch.where(found, key, (1 << 62) - x), stable=True).indices

    return order(surplus, ks, found_s), order(room, kr, found_r)


def _node_major(order: torch.Tensor, ranks_per_node: int | None) -> torch.Tensor:
    """`order` regrouped node by node (keeping its order inside a node)."""
    if ranks_per_node is None:
        return order
    return order[torch.sort(order // ranks_per_node, stable=True).indices]


def _sender_line(
    g_rp: torch.Tensor, ids_rp: torch.Tensor, sent_r: torch.Tensor, order_r: torch.Tensor, recv_end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment pairs `[R * epn]`, segment expert `[R * epn]`): groups in `order_r`, each sending `sent_r`.

    A group whose stretch of the line meets at most epn receivers (`recv_end`, the receivers' line
    ends), each quota (its overlap with one receiver) no larger than a distinct expert (the largest
    quota with the largest expert, and so on), sends every quota from its own expert: one piece per
    quota, as MoonEP's greedy cuts them. Any other group cuts its surplus from its experts largest
    first, the cut before its last (partial) expert moved down onto a receiver boundary when one
    lies where both experts still cover their share: the piece that would straddle it never exists."""
    epn = g_rp.shape[1]
    g, ids = g_rp[order_r], ids_rp[order_r]
    g_sorted, idx = torch.sort(g, dim=1, descending=True, stable=True)
    by_size = ids.gather(1, idx)
    cum = g_sorted.cumsum(1)
    sent = sent_r[order_r].view(-1, 1)
    amount = (torch.minimum(cum, sent) - (cum - g_sorted)).clamp(min=0)  # [R, epn], line order
    start = sent.view(-1).cumsum(0) - sent.view(-1)
    j = ((amount > 0).sum(1, keepdim=True) - 2).clamp(min=0)  # the expert before the last one used
    full_j, full_next = g_sorted.gather(1, j), g_sorted.gather(1, (j + 1).clamp(max=epn - 1))
    upper = start.view(-1, 1) + cum.gather(1, j)  # the cut's place; it may move down to lower
    lower = torch.maximum(start.view(-1, 1) + sent - full_next, upper - full_j)
    bounds = torch.cat([recv_end.new_zeros(1), recv_end])
    b = bounds[torch.searchsorted(bounds, upper, right=True) - 1]
    shift = torch.where((j + 2 <= (amount > 0).sum(1, keepdim=True)) & (b >= lower), upper - b, 0)
    amount = amount.scatter_add(1, j, -shift).scatter_add(1, (j + 1).clamp(max=epn - 1), shift)

    # Quotas: the group's stretch [start, start + sent) cut at the receiver ends, in line order.
    first = torch.searchsorted(bounds, start, right=True).view(-1, 1) - 1  # receiver holding `start`
    k = first + torch.arange(epn, device=g.device)
    last = bounds.numel() - 1
    lo = torch.maximum(start.view(-1, 1), bounds[k.clamp(max=last)])
    quota = (torch.minimum(start.view(-1, 1) + sent, bounds[(k + 1).clamp(max=last)]) - lo).clamp(min=0)
    q_sorted, q_idx = torch.sort(quota, dim=1, descending=True, stable=True)
    aligned = (quota.sum(1, keepdim=True) == sent) & (q_sorted <= g_sorted).all(1, keepdim=True)
    quota_expert = torch.empty_like(by_size).scatter_(1, q_idx, by_size)  # the i-th largest quota's expert
    return (torch.where(aligned, quota, amount).reshape(-1),
            torch.where(aligned, quota_expert, by_size).reshape(-1))


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
    snap: torch.Tensor, nearest: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain's (pairs each group sends `[R]`, receiver line sizes `[2R]`, receiver line ranks
    `[2R]`) for groups in `senders` order and ranks in `receivers` order. Where `snap[j]`, sender j's
    end moves onto a receiver boundary: up (its overshoot becomes a room of rank j right where sender
    j + 1 starts, which pays it back) or, with `nearest`, down where that boundary is closer and a
    sender j + 1 exists (the pairs past it go to rank j + 1, a sender with free slots, which sends them
    on). Ends stay in order (every end inside one receiver snaps the same way or to the same side of
    its midpoint), so sender j still covers its stretch of the line; elsewhere the line is unchanged."""
    R = surplus_r.numel()
    u = surplus_r[senders].cumsum(0)
    bounds = torch.cat([u.new_zeros(1), room_r[receivers].cumsum(0)])  # [R + 1]
    i = torch.searchsorted(bounds, u).clamp(max=R)
    up, down = bounds[i], bounds[(i - 1).clamp(min=0)]
    next_sends = torch.cat([surplus_r[senders[1:]] > 0, u.new_zeros(1, dtype=torch.bool)])
    lower = (u - down < up - u) & next_sends if nearest else torch.zeros_like(snap)
    t = torch.where(snap, torch.where(lower, down, up), u)
    shift = t - u  # > 0: paid back by sender j + 1; < 0: sent on by sender j + 1
    back = torch.cat([shift.new_zeros(1), (-shift[:-1]).clamp(min=0)])  # what sender j sends on for j - 1
    filler = torch.searchsorted(t, bounds[:-1], right=True)  # the first sender whose stretch holds receiver i
    pos = torch.arange(R, device=u.device)
    line = torch.sort(torch.cat([filler * (R + 1) + 1 + pos, (pos + 1) * (R + 1)])).indices
    sizes = torch.cat([room_r[receivers], shift.abs()])[line]
    ranks = torch.cat([receivers, torch.where(shift >= 0, senders, senders.roll(-1))])[line]
    sent = shift.clamp(min=0) + back
    return surplus_r + torch.zeros_like(sent).index_put_((senders,), sent), sizes, ranks


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


def _line(
    g_rp: torch.Tensor, ids_rp: torch.Tensor, surplus: torch.Tensor, room: torch.Tensor, ranks_per_node: int | None,
    components: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The line match of `surplus` `[R]` to `room` `[R]`: (sender order, receiver order, receiver line
    ends, pieces (expert, rank, pairs) `[R * epn + R]`). `components`: lay the exact components
    (components.py) out first, which saves a piece each (not with `ranks_per_node`, whose node order
    would split them)."""
    orders = _equal_first(surplus, room)
    if components and ranks_per_node is None:
        orders = components_first(surplus, room, *orders)
    senders, receivers = (_node_major(o, ranks_per_node) for o in orders)
    recv_end = room[receivers].cumsum(0)
    seg_n, seg_expert = _sender_line(g_rp, ids_rp, surplus, senders, recv_end)
    return senders, receivers, recv_end, _overlap(seg_n, seg_expert, room[receivers], receivers)


def _spread(total: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """`[Q, n]`: each row's `total` `[Q]` split over its `caps` `[Q, n]` as evenly as they allow
    (water-filling: min(cap, level), the remainder one pair each to the first uncapped entries); a
    total above the caps' sum gives every cap."""
    n = caps.shape[1]
    c = caps.sort(1).values
    before = c.cumsum(1) - c
    # Entry i (ascending) is capped iff the level reaches it: before_i + c_i * (n - i) <= total, a
    # prefix of the ascending order, so the capped ones are counted and the level solved in one step.
    capped = (before + c * (n - torch.arange(n, device=c.device)) <= total.view(-1, 1)).sum(1, keepdim=True)
    base = torch.cat([before, c.sum(1, keepdim=True)], 1).gather(1, capped)
    level = (total.view(-1, 1) - base) // (n - capped).clamp(min=1)
    out = torch.minimum(caps, level)
    rest = total.view(-1, 1) - out.sum(1, keepdim=True)
    open_ = caps > level
    return out + (open_ & (open_.long().cumsum(1) <= rest)).long()


def _anchor(
    g_rp: torch.Tensor, ids_rp: torch.Tensor, surplus: torch.Tensor, room: torch.Tensor, slots: torch.Tensor,
    crowded: torch.Tensor,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One anchoring round: every `crowded` receiver (more pieces than its free `slots` in the line
    match), roomiest first, takes one whole piece from each of its own block of the largest senders
    (as many as its free slots), so no chain of small surpluses forms. An anchor sends its surplus
    from its largest expert, and where the block's surpluses fall short of the room, more of that
    expert, spread evenly (so each anchor's overshoot is a room the remaining senders can fill with
    few pieces); the overshoot becomes the anchor's room. Returns (pieces (expert, rank, pairs)
    `[R * epn]`, surplus, room, free slots `[R]`, expert loads left at home `[R, epn]`)."""
    R, epn = g_rp.shape
    receivers = _desc(torch.where(crowded, room, -1))
    free = torch.where(crowded, slots, 0)[receivers]  # [R]: anchors per receiver-order position
    pos = (free.cumsum(0) - free).view(R, 1) + torch.arange(epn, device=g_rp.device)
    valid = (pos < free.view(R, 1) + pos[:, :1]) & (pos < (surplus > 0).sum())
    anchor = _desc(surplus)[pos.clamp(max=R - 1)]  # [R, epn] group of each anchor
    big, j = g_rp[anchor].max(2)  # its largest expert left at home
    base = torch.where(valid, torch.minimum(surplus[anchor], big), 0)
    need = torch.where(crowded[receivers], room[receivers], 0).view(R, 1)
    cum = base.cumsum(1)
    base = (torch.minimum(cum, need) - (cum - base)).clamp(min=0)
    over = _spread((need - base.sum(1, keepdim=True)).clamp(min=0).view(-1), torch.where(valid, big - base, 0))
    n = base + over
    a = anchor.reshape(-1)
    surplus = surplus.index_add(0, a, -base.reshape(-1))
    room = room.index_add(0, a, over.reshape(-1)).index_add(0, receivers, -n.sum(1))
    slots = slots.index_add(0, receivers, -(n > 0).sum(1))
    g_rp = g_rp.reshape(-1).index_add(0, a * epn + j.reshape(-1), -n.reshape(-1)).view(R, epn)
    pieces = (ids_rp[anchor, j].reshape(-1), receivers.view(R, 1).expand(R, epn).reshape(-1), n.reshape(-1))
    return pieces, surplus, room, slots, g_rp


def _rounds(num_ranks: int, epn: int) -> int:
    """Anchoring rounds: a receiver's anchors can be anchored in turn, a tree of fan-in epn, so
    ceil(log_epn R) rounds reach every rank; none at epn 1 (a fan-in of 1 is the chain)."""
    rounds, reach = 0, 1
    while epn > 1 and reach < num_ranks:
        rounds, reach = rounds + 1, reach * epn
    return rounds


def _key(pieces: tuple[torch.Tensor, torch.Tensor, torch.Tensor], fits: torch.Tensor) -> torch.Tensor:
    """0-d ordering key of a candidate: moved pairs, then pieces (copies); unfit candidates last."""
    n = pieces[2]
    return torch.where(fits, n.sum() * (n.numel() + 1) + (n > 0).sum(), torch.iinfo(torch.long).max)


def device_alloc(
    load_e: torch.Tensor, cap_r: torch.Tensor, limit_r: torch.Tensor, homes: Homes, ranks_per_node: int | None = None
) -> torch.Tensor:
    """alloc `[E, R]` int64: pairs of expert e processed on rank r, every rank within its limit (exactly its
    cap when limit == cap), at most epn replicas per rank.

    Candidates (module doc), the fit one that moves the fewest pairs, then makes the fewest pieces,
    kept: for k = 0 .. ceil(log_epn R) anchoring rounds, the line match of what is left after k
    rounds, mended (both ways at k = 0); and the chain at exact caps (always fits). `ranks_per_node` orders both
    lines node by node, so a node's surplus meets its own ranks' room first (where the node's totals
    allow it)."""
    R, epn = homes.num_ranks, homes.epn
    ids_rp = homes.slots(load_e.device)
    g_rp = torch.cat([load_e, load_e.new_zeros(1)])[ids_rp]
    group = g_rp.sum(1)

    surplus, room = (group - limit_r).clamp(min=0), (limit_r - group).clamp(min=0)
    slots, rounds, g_left = torch.full_like(room, epn), _rounds(R, epn), g_rp
    anchors, candidates, fits = [], [], []
    for k in range(rounds + 1):
        # Candidate k: the anchors of k rounds, then the line match of what is left, mended where
        # it would overfill a rank's free slots (the plain line match where nothing is crowded).
        senders, receivers, recv_end, line = _line(g_left, ids_rp, surplus, room, ranks_per_node, components=k == 0)
        crowded = _replicas(line[1], line[2], R) > slots
        u = surplus[senders].cumsum(0)
        inside = torch.searchsorted(recv_end, u, right=True).clamp(max=R - 1)  # the receiver holding u_j
        lower = torch.cat([recv_end.new_zeros(1), recv_end])[inside]
        ends_inside = (u > lower) & crowded[receivers[inside]]
        straddles = ends_inside & (u - surplus[senders] < lower)  # it also meets the receiver before
        # Two mends: snap only the surpluses that straddle into a crowded receiver (each then meets
        # one receiver fewer, at the cost of the few pairs to the nearer boundary), or every one that
        # ends inside it (the crowded receiver then meets one sender; only before any anchoring: on
        # a 80-point sweep and the designed inputs it never won after it).
        for snap in (straddles, ends_inside) if k == 0 else (straddles,):
            sent, sizes, ranks = _chain(surplus, room, senders, receivers, snap, True)
            mended = _overlap(*_sender_line(g_left, ids_rp, sent, senders, sizes.cumsum(0)), sizes, ranks)
            candidates.append(tuple(torch.cat([*(p[i] for p in anchors), mended[i]]) for i in range(3)))
            fits.append((_replicas(candidates[-1][1], candidates[-1][2], R) <= epn).all()
                        & (sent <= g_left.sum(1)).all())
        if k < rounds:
            pieces, surplus, room, slots, g_left = _anchor(g_left, ids_rp, surplus, room, slots, crowded)
            anchors.append(pieces)

    surplus, room = (group - cap_r).clamp(min=0), (cap_r - group).clamp(min=0)
    senders, receivers = _desc(surplus), _desc(room)
    sent, sizes, ranks = _chain(surplus, room, senders, receivers, torch.ones_like(senders, dtype=torch.bool), False)
    chain = _overlap(*_sender_line(g_rp, ids_rp, sent, senders, sizes.cumsum(0)), sizes, ranks)

    candidates.append(chain)
    fits.append(torch.ones_like(fits[0]))
    size = max(c[0].numel() for c in candidates)
    candidates = [tuple(torch.cat([x, x.new_zeros(size - x.numel())]) for x in c) for c in candidates]
    keys = torch.stack([_key(c, f) for c, f in zip(candidates, fits, strict=True)])
    choice = torch.argmin(keys)
    # index_select, not [choice]: indexing with a 0-d tensor reads it on the host
    e, d, n = (torch.stack(c).index_select(0, choice.view(1))[0] for c in zip(*candidates, strict=True))
    return _alloc(load_e, homes, e, d, n)
