"""Shared checks of a plan: every invariant, the slot map against a naive oracle, adversarial routings."""

from __future__ import annotations

import torch

from k3sys.ep.homes import Homes


def group_start(p, rank: int, group: int) -> int:
    return 0 if group == 0 else int(p.cu_seqlens[rank, group - 1])


def expert_group(p, expert: int, rank: int) -> int:
    """Group index of `expert` on `rank`: its home slot there, else its replica slot."""
    if p.homes.rank_of(expert) == rank:
        return p.homes.local(expert)
    return p.experts_per_rank + p.replicas[rank].tolist().index(expert)


def check_plan(p, tpe: torch.Tensor, top_k: int, capacity: int, token_padding: int, tolerance: float = 0.0):
    R, E = tpe.shape
    homes = Homes(E, R)
    epn = homes.epn
    slots = int(tpe.sum())
    cap = torch.tensor([slots // R + (r < slots % R) for r in range(R)])
    assert torch.equal(p.cap, cap)
    if tolerance == 0:
        assert torch.equal(p.loads, cap), "every rank receives exactly its cap"
    else:
        assert bool((p.loads <= cap + (cap * tolerance).floor().long()).all())
    assert bool((p.alloc >= 0).all())
    assert torch.equal(p.alloc.sum(1), tpe.sum(0)), "every expert's pairs are conserved"
    remote = p.alloc.clone()
    remote[torch.arange(E), homes.rank_of(torch.arange(E))] = 0
    assert p.moved_tokens == int(remote.sum())
    assert p.num_copies == int((remote > 0).sum())
    assert p.replicas.shape == (R, epn) and p.cu_seqlens.shape == (R, 2 * epn)
    for r in range(R):
        used = [e for e in p.replicas[r].tolist() if e >= 0]
        assert p.replicas[r].tolist() == used + [-1] * (epn - len(used)), "used slots first"
        assert used == sorted(used) and len(set(used)) == len(used)
        assert used == torch.nonzero(remote[:, r]).view(-1).tolist(), "replicas are exactly the remote experts"
    assert bool((p.cu_seqlens.diff(dim=1) >= 0).all()) and bool((p.cu_seqlens >= 0).all())
    assert bool((p.cu_seqlens % token_padding == 0).all())
    rows_cap = capacity * top_k + int(capacity * top_k * tolerance)
    expected_rows = -(-(rows_cap + (token_padding - 1) * 2 * epn) // token_padding) * token_padding
    assert p.buffer_rows == expected_rows
    assert bool((p.cu_seqlens[:, -1] <= p.buffer_rows).all())
    for r in range(R):
        for g in range(2 * epn):
            e = (homes.start(r) + g if g < homes.count(r) else -1) if g < epn else int(p.replicas[r, g - epn])
            n = 0 if e < 0 else int(p.alloc[e, r])
            padded = -(-n // token_padding) * token_padding
            assert int(p.cu_seqlens[r, g]) - group_start(p, r, g) == padded


def reference_slots(p, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive slot map: each expert's pairs in (source rank, token, k) order, dealt out to destinations in
    ascending rank order, alloc[e, d] each, rows counted from the expert's group start."""
    R, s, K = topk.shape
    pairs: dict[int, list[tuple[int, int, int]]] = {}
    for r in range(R):
        for t in range(s):
            for k in range(K):
                pairs.setdefault(int(topk[r, t, k]), []).append((r, t, k))
    dst = torch.full_like(topk, -1)
    row = torch.full_like(topk, -1)
    for e, lst in pairs.items():
        i = 0
        for d in range(R):
            start = group_start(p, d, expert_group(p, e, d)) if p.alloc[e, d] else 0
            for j in range(int(p.alloc[e, d])):
                dst[lst[i]], row[lst[i]] = d, start + j
                i += 1
    return dst, row


def check_slots(p, topk: torch.Tensor):
    """slots() of all ranks together fill every destination's groups exactly once."""
    R = topk.shape[0]
    dst, row = zip(*(p.slots(r, topk[r]) for r in range(R)), strict=True)
    dst, row = torch.stack(dst), torch.stack(row)
    for d in range(R):
        mine = dst == d
        rows = row[mine]
        assert rows.unique().numel() == rows.numel(), "no two pairs share a row"
        assert rows.numel() == int(p.loads[d])
        # Each row lies inside the unpadded part of its own expert's group.
        for e in topk[mine].unique().tolist():
            g = expert_group(p, e, d)
            lo = group_start(p, d, g)
            r_e = row[mine & (topk == e)]
            assert int(r_e.min()) >= lo and int(r_e.max()) < lo + int(p.alloc[e, d])
    sent = torch.zeros(R, R, dtype=torch.long)
    for r in range(R):
        sent[r] = torch.bincount(dst[r].reshape(-1), minlength=R)
    assert torch.equal(p.traffic(), sent)
    for r in range(R):
        send, recv = p.traffic_of(r)
        assert torch.equal(send, sent[r]) and torch.equal(recv, sent[:, r])
    for d in range(R):
        # Sources pack each destination's pairs by row; the all-to-all concatenates them by source.
        delivered = torch.cat([row[r][dst[r] == d].sort().values for r in range(R)])
        assert torch.equal(p.recv_rows(d), delivered)
    return dst, row


def routing_hot_expert(R: int, s: int, E: int, K: int) -> torch.Tensor:
    """Every token picks expert 0 (plus K-1 others): all tokens to one expert."""
    g = torch.Generator().manual_seed(0)
    rest = torch.rand(R, s, E - 1, generator=g).topk(K - 1, dim=-1).indices + 1
    return torch.cat([torch.zeros(R, s, 1, dtype=torch.long), rest], dim=-1)


def routing_hot_rank(R: int, s: int, E: int, K: int) -> torch.Tensor:
    """Every token picks among rank 0's home experts first: one hot rank."""
    epn = Homes(E, R).count(0)
    g = torch.Generator().manual_seed(1)
    score = torch.rand(R, s, E, generator=g)
    score[..., :epn] += 1
    return score.topk(K, dim=-1).indices


def routing_uniform(R: int, s: int, E: int, K: int) -> torch.Tensor:
    """Token t picks experts t*K .. t*K+K-1 (mod E): every expert gets the same count when E | s*K."""
    t = torch.arange(s).view(1, s, 1) * K + torch.arange(K).view(1, 1, K)
    return (t % E).expand(R, s, K).contiguous()


def fan_in_bound(tpe: torch.Tensor, limit: torch.Tensor) -> int:
    """A lower bound on moved pairs that counts replica slots (docs/ep.md, "Designed inputs"): a rank
    takes pieces from at most epn other groups, so at most m * (epn + ... + epn^k) groups lie within k
    hops of the m ranks with room, and a surplus k hops away crosses k ranks. The largest surpluses
    nearest: sum_i surplus_(i) * hops(i). Equals sum_r max(0, home load_r - limit_r) when the senders
    fit next to the receivers (n <= m * epn)."""
    R, E = tpe.shape
    epn = Homes(E, R).epn
    group = Homes(E, R).group_sum(tpe.sum(0))
    surplus = (group - limit).clamp(min=0).sort(descending=True).values
    m = int((group < limit).sum())
    bound, hops, reach = 0, 0, 0
    for i, x in enumerate(surplus.tolist()):
        while x and i >= reach:  # i (0-based) needs more hops than the ones so far reach
            hops += 1
            reach += m * epn**hops
        bound += x * hops
    return bound


def tpe_from_loads(load_e: torch.Tensor, R: int, s: int, K: int) -> torch.Tensor:
    """`[R, E]` counts with expert loads `load_e` `[E]` (summing to R*s*K): the expert line dealt out
    pair by pair to ranks in turn, so every row sums to s*K and no entry exceeds s."""
    E = load_e.numel()
    end = load_e.cumsum(0).view(1, E)
    r = torch.arange(R).view(R, 1)
    dealt = lambda x: torch.div(x - r - 1, R, rounding_mode="floor") + 1  # line positions p < x with p % R == r
    return dealt(end) - dealt(end - load_e.view(1, E))


def routing_from_tpe(tpe: torch.Tensor, s: int, K: int) -> torch.Tensor:
    """`[R, s, K]` ids with counts `tpe`: each rank's pairs laid out expert by expert, pair p to token
    p % s (an expert has at most s pairs, so no token picks it twice)."""
    R, E = tpe.shape
    ids = torch.repeat_interleave(torch.arange(E).repeat(R), tpe.reshape(-1)).view(R, K, s)
    return ids.transpose(1, 2).contiguous()


def _even(total: int, n: int) -> torch.Tensor:
    return torch.full((n,), total // n) + (torch.arange(n) < total % n).long()


def group_loads(group: list[int], E: int, R: int, s: int, K: int) -> torch.Tensor:
    """tpe `[R, E]` whose home groups carry `group` `[R]` pairs, each spread evenly over its experts."""
    homes = Homes(E, R)
    load = torch.cat([_even(g, homes.count(r)) for r, g in enumerate(group)])
    return tpe_from_loads(load, R, s, K)


def cold_ranks(R: int, E: int, s: int, K: int, cold: int = 1) -> torch.Tensor:
    """tpe `[R, E]`: the home groups of ranks 0 .. cold-1 get nothing, the others share every pair evenly
    (issue 29's `cold_rank` with cold=1)."""
    return group_loads([0] * cold + _even(R * s * K, R - cold).tolist(), E, R, s, K)


def tiny_surplus(R: int, E: int, s: int, K: int) -> torch.Tensor:
    """tpe `[R, E]`: home groups 0 .. R-2 one pair over their cap, rank R-1 short by R-1 pairs."""
    return group_loads([s * K + 1] * (R - 1) + [s * K - (R - 1)], E, R, s, K)


def all_to_one_rank(R: int, E: int, s: int, K: int) -> torch.Tensor:
    """tpe `[R, E]`: every token picks all of rank 0's home experts, its other picks spread evenly."""
    n0 = Homes(E, R).count(0)
    load = torch.cat([torch.full((n0,), R * s), _even(R * s * (K - n0), E - n0)])
    return tpe_from_loads(load, R, s, K)
