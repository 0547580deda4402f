"""Cost model of one MoE layer step at K3 scale: our planner against the baselines, per maxvio.

Per rank, a step is dispatch, the expert FFN's grouped GEMM, combine, plus whatever replica weights
the rank serves or fetches; the step takes as long as the slowest rank.
- compute: pairs x 6 H F FLOPs at the achieved grouped-GEMM rate.
- dispatch, combine: the all-to-all of the token rows, one way and back. A transfer occupies four
  links per rank (NVLink send and receive inside a node, network send and receive across nodes, all
  independent and full duplex); it lasts as long as its busiest link.
- prefetch: our replicas' weights, sent from the home rank each step. `Schedule.prefetch_overlap` of
  the weight bytes move concurrently with the dispatch (the planner needs only the router counts,
  which exist before dispatch, as in MoonEP, so the transfers can start together) and share its
  links: bytes on the same link add up, bytes on different links overlap. The rest moves after the
  dispatch. prefetch = what the weights add to the step beyond the dispatch alone; with an overlap
  of 0 it is the time of the weights alone, the serial model.
- rebalance: a placement that holds still between rebalances (eplb) re-fetches the slots whose expert
  changed every `Schedule.eplb_interval` steps; that transfer, spread over the interval.
Only the forward pass of one MoE layer is priced (no backward, no replica gradient reduce), and
compute never overlaps communication. The prefetch could also hide under the home experts' GEMMs,
and a replica could relay weights to the next; neither is modelled (both would favour ours).

Defaults (all arguments):
- H200 SXM: 989 TFLOP/s dense BF16 (NVIDIA H100/H200 datasheet, without sparsity), of which
  grouped GEMMs of this shape reach an assumed 60%; NVLink 4 at 900 GB/s per GPU bidirectional,
  so 450 GB/s each way; one 400 Gb/s InfiniBand NIC per GPU (ConnectX-7), 50 GB/s each way;
  8 GPUs per node.
- K3's MoE layer: hidden 7168, expert FFN 2048 (SwiGLU: three H x F matrices, 6 H F FLOPs per pair),
  896 experts, top-16, bf16 activations and weights; 4096 tokens per rank.
- Schedule: prefetch fully overlapped with dispatch (what MoonEP does); EPLB rebalanced every 100
  steps (an assumption: DeepSeek-V3 rebalances its serving deployment "periodically", e.g. every
  10 minutes, and publishes no training interval; `eplb_interval=1` prices following every step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from k3sys.ep import baselines
from k3sys.ep.baselines import Placement
from k3sys.ep.homes import Homes
from k3sys.ep.planner import plan
from k3sys.ep.routing import balancedness, make_routing, tokens_per_expert
from k3sys.ep.routing import maxvio as _maxvio_of

__all__ = [
    "H200", "K3_MOE", "MOONEP", "Comparison", "Hardware", "MoEShape", "Schedule", "StepCost", "break_even_tolerance",
    "compare", "step_cost",
]


@dataclass(frozen=True)
class Hardware:
    peak_flops: float = 989e12  # dense BF16 FLOP/s per GPU
    gemm_efficiency: float = 0.6  # achieved fraction of peak in the grouped expert GEMMs (assumed)
    nvlink_bytes_per_s: float = 450e9  # per direction per GPU, inside a node
    network_bytes_per_s: float = 50e9  # per direction per GPU, across nodes (400 Gb/s)
    ranks_per_node: int = 8


@dataclass(frozen=True)
class MoEShape:
    hidden: int = 7168
    ffn: int = 2048
    bytes_per_elem: int = 2  # bf16 activations and weights

    @property
    def flops_per_pair(self) -> float:
        return 6.0 * self.hidden * self.ffn

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.ffn * self.bytes_per_elem


@dataclass(frozen=True)
class Schedule:
    """How the runtime orders its transfers.

    prefetch_overlap: fraction in [0, 1] of the replica weight bytes sent concurrently with the
        dispatch, sharing its links; the rest is sent after it. 1 (default): MoonEP's schedule; 0: the
        serial model.
    eplb_interval: steps between EPLB rebalances (>= 1); default 100, an assumption.
    """

    prefetch_overlap: float = 1.0
    eplb_interval: int = 100

    def __post_init__(self) -> None:
        if not 0 <= self.prefetch_overlap <= 1:
            raise ValueError(f"prefetch_overlap must be in [0, 1], got {self.prefetch_overlap}")
        if self.eplb_interval < 1:
            raise ValueError(f"eplb_interval must be >= 1, got {self.eplb_interval}")


H200 = Hardware()
K3_MOE = MoEShape()
MOONEP = Schedule()


@dataclass(frozen=True)
class StepCost:
    """Seconds per rank `[R]` float64 for each part; `step` is the slowest rank's total.

    prefetch is what the replica weights add beyond the dispatch alone; rebalance is eplb's periodic
    weight moves spread over the steps between them.
    """

    compute: torch.Tensor
    dispatch: torch.Tensor
    combine: torch.Tensor
    prefetch: torch.Tensor
    rebalance: torch.Tensor

    @property
    def all_to_all(self) -> torch.Tensor:
        return self.dispatch + self.combine

    @property
    def total(self) -> torch.Tensor:
        return self.compute + self.dispatch + self.combine + self.prefetch + self.rebalance

    @property
    def step(self) -> float:
        return float(self.total.max())


def _link_bytes(bytes_sd: torch.Tensor, hw: Hardware) -> torch.Tensor:
    """`[R, 4]` bytes each rank puts on its NVLink send, NVLink receive, network send and network
    receive links to move `[R, R]` bytes (source, destination); a rank's bytes to itself stay local."""
    R = bytes_sd.shape[0]
    node = torch.arange(R) // hw.ranks_per_node
    same = node.view(R, 1) == node.view(1, R)
    off = ~torch.eye(R, dtype=torch.bool)
    intra = torch.where(same & off, bytes_sd, 0.0)
    inter = torch.where(~same, bytes_sd, 0.0)
    return torch.stack([intra.sum(1), intra.sum(0), inter.sum(1), inter.sum(0)], 1)


def _busy_seconds(link_bytes: torch.Tensor, hw: Hardware) -> torch.Tensor:
    """`[R]` seconds until the busiest of each rank's four links has moved its `[R, 4]` bytes."""
    rate = torch.tensor([hw.nvlink_bytes_per_s, hw.nvlink_bytes_per_s, hw.network_bytes_per_s,
                         hw.network_bytes_per_s], dtype=torch.float64)
    return (link_bytes / rate).max(1).values


def step_cost(p: Placement, shape: MoEShape = K3_MOE, hw: Hardware = H200, schedule: Schedule = MOONEP) -> StepCost:
    """Per-rank time of one forward MoE layer step under placement `p` (see the module doc)."""
    compute = p.loads.double() * shape.flops_per_pair / (hw.peak_flops * hw.gemm_efficiency)
    tokens = _link_bytes(p.traffic.double() * shape.hidden * shape.bytes_per_elem, hw)
    weights = _link_bytes(p.fetched.double() * shape.expert_bytes, hw)
    dispatch = _busy_seconds(tokens, hw)
    f = schedule.prefetch_overlap
    prefetch = _busy_seconds(tokens + f * weights, hw) - dispatch + _busy_seconds((1 - f) * weights, hw)
    # Combine sends the same rows back: each link carries what its opposite carried, same busiest time.
    rebalance = torch.zeros_like(compute)
    if p.rebalance is not None:
        moved = _link_bytes(p.rebalance.double() * shape.expert_bytes, hw)
        rebalance = _busy_seconds(moved, hw) / schedule.eplb_interval
    return StepCost(compute, dispatch, dispatch.clone(), prefetch, rebalance)


def break_even_tolerance(tokens_per_rank: int, top_k: int, shape: MoEShape = K3_MOE, hw: Hardware = H200) -> float:
    """The load above its cap at which a rank's extra compute costs as much as fetching one replica
    over NVLink: (NVLink fetch time of one expert / compute time of one pair) pairs, as a fraction of
    the cap s*K. Below it a replica cannot pay for itself even inside a node (across nodes it costs
    ~9x more), so plans that leave such overloads in place lose nothing. 1318 pairs = 2.0% of 65,536
    at the H200 / K3 defaults (the ratio does not depend on H and F: both scale with H F)."""
    pairs = (shape.expert_bytes / hw.nvlink_bytes_per_s) / (shape.flops_per_pair / (hw.peak_flops * hw.gemm_efficiency))
    return pairs / (tokens_per_rank * top_k)


def _perfect(R: int, tokens_per_rank: int, top_k: int) -> Placement:
    """Every rank computes s*K pairs and sends s*K/R to every rank, nothing fetched."""
    pairs = tokens_per_rank * top_k
    traffic = torch.full((R, R), pairs / R, dtype=torch.float64)
    return Placement(torch.full((R,), pairs, dtype=torch.long), traffic, torch.zeros(R, R))


@dataclass(frozen=True)
class Comparison:
    """One routing's outcome: realised maxvio, {method: figures} (see `compare`) and the step's
    tpe `[R, E']` (experts padded to a multiple of R) the planners ran on."""

    maxvio: float
    methods: dict[str, dict[str, float]]
    tpe: torch.Tensor


def compare(
    maxvio: float,
    num_ranks: int = 64,
    *,
    num_experts: int = 896,
    top_k: int = 16,
    tokens_per_rank: int = 4096,
    hot_shift: float = 0.0,
    capacity_factor: float = 1.25,
    tolerance: float | None = None,
    seed: int = 0,
    dist: str = "lognormal",
    shape: MoEShape = K3_MOE,
    hw: Hardware = H200,
    schedule: Schedule = MOONEP,
) -> Comparison:
    """K3-scale balance at one maxvio: every method's step time against perfect balance.

    The routing has `dist` preferences ("lognormal" or "zipf") skewed to `maxvio`; `hot_shift` moves
    that fraction of them after eplb's last rebalance. Methods: "static"; "capacity" (factor
    `capacity_factor`); "eplb", planned from a past window of the preferences before hot_shift moved
    them (fresh at hot_shift 0, stale otherwise) and rebalanced every `schedule.eplb_interval` steps,
    a rebalance priced by what it moves between two windows of the same preferences (sampling noise
    alone: the least any rebalance moves, in eplb's favour); "greedy" (MoonEP's planner); "ours"
    (exact caps); "ours_node" (exact, node-aware); "ours_tol" (node-aware, loads within 1 +
    `tolerance` of the cap; default `break_even_tolerance`).
    Figures: step_ms, relative (to perfect balance), relative_serial (the same under the serial
    schedule, prefetch after dispatch), compute_ms, all_to_all_ms, prefetch_ms and rebalance_ms of the
    slowest rank, balancedness, peak_rows (largest rank's pairs / (s*K)), dropped_pct; for eplb also
    moved_copies per rebalance; for the planners copies, moved_tokens and lower_bound (sum over ranks
    of the home load above the limit).
    """
    R, E, K, s = num_ranks, num_experts, top_k, tokens_per_rank
    if tolerance is None:
        tolerance = break_even_tolerance(s, K, shape, hw)

    def window(step: int, shift: float) -> torch.Tensor:
        ids = make_routing(R, s, E, K, maxvio, seed=seed, hot_shift=shift, step=step, dist=dist)
        return tokens_per_expert(ids, E)

    now = window(0, hot_shift)
    methods: dict[str, Placement] = {
        "static": baselines.static(now),
        "eplb": baselines.eplb(now, window(1, 0.0).sum(0), 2 * Homes(E, R).epn,
                               previous_load=window(2, 0.0).sum(0)),
        "capacity": baselines.capacity(now, capacity_factor),
    }
    plans = {
        "greedy": plan(now, K, strategy="greedy"),
        "ours": plan(now, K),
        "ours_node": plan(now, K, ranks_per_node=hw.ranks_per_node),
        "ours_tol": plan(now, K, tolerance=tolerance, ranks_per_node=hw.ranks_per_node),
    }
    methods |= {name: baselines.from_plan(p) for name, p in plans.items()}
    serial = replace(schedule, prefetch_overlap=0.0)
    ideal = step_cost(_perfect(R, s, K), shape, hw, schedule).step  # nothing fetched: the same for any schedule
    out = {}
    for name, placement in methods.items():
        cost = step_cost(placement, shape, hw, schedule)
        slowest = int(cost.total.argmax())
        out[name] = {
            "step_ms": 1e3 * cost.step,
            "relative": cost.step / ideal,
            "relative_serial": step_cost(placement, shape, hw, serial).step / ideal,
            "compute_ms": 1e3 * float(cost.compute[slowest]),
            "all_to_all_ms": 1e3 * float(cost.all_to_all[slowest]),
            "prefetch_ms": 1e3 * float(cost.prefetch[slowest]),
            "rebalance_ms": 1e3 * float(cost.rebalance[slowest]),
            "balancedness": balancedness(placement.loads),
            "peak_rows": float(placement.loads.max()) / (s * K),
            "dropped_pct": 100.0 * placement.dropped / (R * s * K),
        }
        if placement.rebalance is not None:
            out[name]["moved_copies"] = int(placement.rebalance.sum())
    for name, p in plans.items():
        out[name] |= {"copies": p.num_copies, "moved_tokens": p.moved_tokens, "lower_bound": p.moved_lower_bound}
    return Comparison(maxvio=_maxvio_of(now.sum(0)), methods=out, tpe=now)
