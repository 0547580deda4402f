"""Plain single-process reference of every `EPBuffer` collective path: the test oracle.

Each function takes every rank's inputs as a list indexed by rank and returns every rank's result,
by direct indexing with the plan's slot map: no staging, no splits, no process group. The real
transfers only move values, so they must match these bit for bit. Expert homes come from the plan's
`Homes` (E need not be a multiple of R: rank r holds `homes.count(r)` experts, epn or epn - 1).
"""

from __future__ import annotations

import torch

from k3sys.ep.experts import weighted_sum
from k3sys.ep.planner import Plan

__all__ = ["combine_reference", "dispatch_reference", "prefetch_reference", "reduce_grads_reference"]


def _slots(p: Plan, rank: int, ids_sk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # EPBuffer plans every token-k pair as a token of a top-1 routing (see `EPBuffer._plan`). The
    # slot map's host check (check=True) runs here: the buffer skips it, the tests keep it.
    dst_rank, dst_row = p.slots(rank, ids_sk.reshape(-1, p.top_k), check=True)
    return dst_rank.view_as(ids_sk), dst_row.view_as(ids_sk)


def dispatch_reference(
    p: Plan, xs: list[torch.Tensor], topk_ids: list[torch.Tensor], topk_weights: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each rank's receive buffer `[buffer_rows, H]` and row weights `[buffer_rows]` (fp32).

    Row `dst_row` of rank `dst_rank` holds its pair's token and weight; rows no pair lands in are zero
    (the real token buffer leaves them stale). Differentiable in xs.
    """
    R, H = p.num_ranks, xs[0].shape[1]
    recv_x = [xs[0].new_zeros(p.buffer_rows, H) for _ in range(R)]
    recv_w = [torch.zeros(p.buffer_rows) for _ in range(R)]
    for src, (x_sh, ids_sk, w_sk) in enumerate(zip(xs, topk_ids, topk_weights, strict=True)):
        dst_rank_sk, dst_row_sk = _slots(p, src, ids_sk)
        token_sk = torch.arange(x_sh.shape[0]).view(-1, 1).expand_as(ids_sk)
        for dst in range(R):
            at = dst_rank_sk == dst
            recv_x[dst][dst_row_sk[at]] = x_sh[token_sk[at]]
            recv_w[dst][dst_row_sk[at]] = w_sk[at].detach().float()
    return recv_x, recv_w


def combine_reference(
    p: Plan, expert_outs: list[torch.Tensor], topk_ids: list[torch.Tensor], topk_weights: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Each rank's `[s, H]`: `sum_k w[t, k] * expert_outs[dst_rank][dst_row]` for its pairs."""
    outs = []
    for src, (ids_sk, w_sk) in enumerate(zip(topk_ids, topk_weights, strict=True)):
        dst_rank_sk, dst_row_sk = _slots(p, src, ids_sk)
        y_skh = torch.stack(expert_outs)[dst_rank_sk, dst_row_sk]
        outs.append(weighted_sum(w_sk, y_skh))
    return outs


def prefetch_reference(p: Plan, home: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each rank's replica slots `[epn, ...]` per name, from every rank's home weights (`[homes.count(r),
    ...]` per name): slot j holds expert `replicas[rank, j]` (zeros if unused)."""
    homes, epn = p.homes, p.experts_per_rank
    out = []
    for rank in range(p.num_ranks):
        slots = {}
        for name, w in home[rank].items():
            slots[name] = w.new_zeros(epn, *w.shape[1:])
            for j, e in enumerate(p.replicas[rank].tolist()):
                if e >= 0:
                    slots[name][j] = home[homes.rank_of(e)][name][homes.local(e)]
        out.append(slots)
    return out


def reduce_grads_reference(p: Plan, grads: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each rank's `[homes.count(rank), ...]` per name: the sum of the replica-slot gradients (`[epn, ...]`
    per name on every rank) of its home experts."""
    homes = p.homes
    out = [{name: g.new_zeros(homes.count(r), *g.shape[1:]) for name, g in grads[0].items()}
           for r in range(p.num_ranks)]
    for rank in range(p.num_ranks):
        for j, e in enumerate(p.replicas[rank].tolist()):
            if e >= 0:
                for name, g in grads[rank].items():
                    out[homes.rank_of(e)][name][homes.local(e)] += g[j]
    return out
