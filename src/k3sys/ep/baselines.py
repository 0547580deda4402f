"""What one MoE step puts on each rank under our plan and under the baselines it is measured against.

Every method turns the step's tpe `[R, E]` into a `Placement`: pairs computed per rank, pairs sent
between ranks, expert weights copied between ranks, pairs dropped. `k3sys.ep.sim` prices placements.

- `static`: home placement, no replicas, nothing dropped: plain all-to-all EP (what DeepEP does);
  the hottest rank sets the step.
- `eplb`: DeepSeek EPLB's idea, from a past window's loads: replicate the expert with the largest
  load per replica until every physical slot is used, then pack the replicas onto ranks, heaviest
  first onto the lightest rank with a free slot. At run time every source splits an expert's pairs
  evenly over its replicas. The placement holds still between rebalances, so no weights move per
  step; a rebalance plans from scratch (as deepseek-ai/EPLB does) and re-fetches every slot whose
  expert changed (`eplb_moves`), a cost the simulator spreads over the steps between rebalances.
- `capacity`: home placement with a capacity factor c: each source rank keeps at most
  ceil(c * s_r * K / E) pairs per expert (decided locally before dispatch, GShard style) and drops
  the rest.
- `from_plan`: our plan; replicas are fetched from their home rank every step.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from k3sys.ep.homes import Homes
from k3sys.ep.planner import Plan

__all__ = ["Placement", "capacity", "eplb", "eplb_moves", "eplb_slots", "from_plan", "static"]


@dataclass(frozen=True, eq=False)
class Placement:
    """One step's work per rank (int64 tensors on the CPU).

    - loads `[R]`: pairs each rank computes.
    - traffic `[R, R]`: pairs each source rank sends to each rank (the diagonal stays local).
    - fetched `[R, R]`: expert weight copies each rank sends to each rank this step.
    - dropped: pairs never computed.
    - rebalance `[R, R]`: expert weight copies each rank sends each rank at a rebalance of a placement
      that holds still between rebalances (eplb), None for a per-step one.
    """

    loads: torch.Tensor
    traffic: torch.Tensor
    fetched: torch.Tensor
    dropped: int = 0
    rebalance: torch.Tensor | None = None


def _home(kept: torch.Tensor, dropped: int = 0) -> Placement:
    """Home placement of `kept` `[R, E]` pairs."""
    R, E = kept.shape
    traffic = Homes(E, R).group_sum(kept)
    return Placement(traffic.sum(0), traffic, torch.zeros(R, R, dtype=torch.long), dropped)


def static(tpe: torch.Tensor) -> Placement:
    """No balancing: every pair goes to its expert's home rank."""
    return _home(tpe.long().cpu())


def capacity(tpe: torch.Tensor, factor: float = 1.25) -> Placement:
    """Home placement, pairs over ceil(factor * s_r * K / E) per (source rank, expert) dropped."""
    tpe = tpe.long().cpu()
    R, E = tpe.shape
    limit = torch.tensor([math.ceil(factor * int(n) / E) for n in tpe.sum(1)]).view(R, 1)
    kept = tpe.minimum(limit)
    return _home(kept, int((tpe - kept).sum()))


def eplb_replicas(past_load: torch.Tensor, num_slots: int, num_ranks: int) -> torch.Tensor:
    """`[E]` replica counts: one each, then the expert with the largest load per replica gets the next
    slot (at most one replica per rank). Equals taking the top values of load_e / j, j = 1, 2, ...
    (the D'Hondt apportionment), which is what is computed, ties to the lower expert id."""
    E = past_load.numel()
    extra = num_slots - E
    if not 0 <= extra <= E * (num_ranks - 1):
        raise ValueError(f"num_slots ({num_slots}) must be in [num_experts, num_experts * num_ranks] = "
                         f"[{E}, {E * num_ranks}]: at most one replica of an expert per rank")
    per_replica = past_load.double().view(E, 1) / torch.arange(1, num_ranks, dtype=torch.float64)  # [E, R-1]
    order = torch.argsort(-per_replica.reshape(-1), stable=True)[:extra]
    return 1 + torch.bincount(order // (num_ranks - 1), minlength=E)


def eplb_slots(past_load: torch.Tensor, slots_per_rank: int, num_ranks: int) -> torch.Tensor:
    """`[P, 2]` (expert, rank) of every physical expert EPLB places from `past_load` `[E]`, with
    `slots_per_rank` slots on each of `num_ranks` ranks (P = slots_per_rank * R), grouped by expert."""
    E, R = past_load.numel(), num_ranks
    if slots_per_rank * R < E:
        raise ValueError(f"slots_per_rank ({slots_per_rank}) * R ({R}) must be >= E ({E})")
    count = eplb_replicas(past_load.cpu(), slots_per_rank * R, R)
    expert = torch.repeat_interleave(torch.arange(E), count)  # [P] physical experts
    weight = (past_load.cpu().double() / count)[expert].tolist()
    # Balanced packing: heaviest replica first onto the lightest rank that still has a free slot.
    rank_of = [0] * len(weight)
    free = [slots_per_rank] * R
    heap = [(0.0, r) for r in range(R)]
    for p in sorted(range(len(weight)), key=lambda p: (-weight[p], p)):
        load, r = heapq.heappop(heap)
        rank_of[p] = r
        free[r] -= 1
        if free[r]:
            heapq.heappush(heap, (load + weight[p], r))
    return torch.stack([expert, torch.tensor(rank_of)], 1)


def eplb(tpe: torch.Tensor, past_load: torch.Tensor, slots_per_rank: int,
         previous_load: torch.Tensor | None = None) -> Placement:
    """EPLB-style placement planned from `past_load` `[E]`, applied to this step's `tpe` `[R, E]`.

    `slots_per_rank` physical expert slots per rank (2 * E / R gives eplb the memory of our epn home
    plus epn replica slots). `previous_load` `[E]`: the window the rebalance before planned from;
    given, `rebalance` holds what going from that placement to this one sends (`eplb_moves`).
    """
    tpe = tpe.long().cpu()
    R, E = tpe.shape
    slots = eplb_slots(past_load, slots_per_rank, R)
    expert, rank = slots.unbind(1)
    count = torch.bincount(expert, minlength=E)
    # Each source splits its pairs of e evenly over e's replicas; the remainder rotates with the source.
    first = torch.cumsum(count, 0) - count
    j = torch.arange(expert.numel()) - first[expert]  # [P] replica index within its expert
    n = count[expert]
    share = tpe[:, expert] // n + ((j - torch.arange(R).view(R, 1)) % n < tpe[:, expert] % n).long()  # [R, P]
    traffic = torch.zeros(R, R, dtype=torch.long).index_add_(1, rank, share)
    moves = None if previous_load is None else eplb_moves(eplb_slots(previous_load, slots_per_rank, R), slots, R)
    return Placement(traffic.sum(0), traffic, torch.zeros(R, R, dtype=torch.long), rebalance=moves)


def eplb_moves(old: torch.Tensor, new: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """`[R, R]` expert weight copies each rank sends each rank to go from placement `old` to `new`
    (`[P, 2]` (expert, rank) rows, see `eplb_slots`).

    A rank fetches each expert it holds more copies of than before; the source is a rank that held
    that expert before, the one that has sent the fewest copies so far (ties to the lowest rank).
    """
    R = num_ranks
    E = int(torch.cat([old[:, 0], new[:, 0]]).max()) + 1
    before = torch.zeros(E, R, dtype=torch.long).index_put_((old[:, 0], old[:, 1]), torch.ones(len(old),
                                                            dtype=torch.long), accumulate=True)
    after = torch.zeros(E, R, dtype=torch.long).index_put_((new[:, 0], new[:, 1]), torch.ones(len(new),
                                                           dtype=torch.long), accumulate=True)
    holders = [torch.nonzero(row).flatten().tolist() for row in before]
    sent = [0] * R
    moves = torch.zeros(R, R, dtype=torch.long)
    for e, dest in torch.nonzero(after > before).tolist():
        for _ in range(int(after[e, dest] - before[e, dest])):
            src = min(holders[e], key=lambda r: (sent[r], r))
            sent[src] += 1
            moves[src, dest] += 1
    return moves


def from_plan(p: Plan) -> Placement:
    """Our plan: pairs where the plan puts them, every replica fetched from its expert's home rank."""
    R = p.num_ranks
    rank, slot = torch.nonzero(p.replicas >= 0, as_tuple=True)
    home = p.homes.rank_of(p.replicas[rank, slot])
    fetched = torch.zeros(R * R, dtype=torch.long, device=rank.device).index_add_(
        0, home * R + rank, torch.ones_like(rank)
    )
    return Placement(p.loads.cpu(), p.traffic().cpu(), fetched.view(R, R).cpu())
