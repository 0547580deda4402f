"""Cost model of one MoE layer step at K3 scale: our planner against the baselines, per maxvio.

Per rank: compute time proportional to the pairs it computes (the expert FFN's grouped GEMM), plus
its all-to-all time (dispatch and combine: the larger of its send and receive bytes, NVLink inside a
node and the network across nodes running in parallel), plus the time to fetch replica weights.
The step takes as long as the slowest rank. No overlap between the three parts is assumed.

Defaults (all arguments):
- H200 SXM: 989 TFLOP/s dense BF16 (NVIDIA H100/H200 datasheet, without sparsity), of which
  grouped GEMMs of this shape reach an assumed 60%; NVLink 4 at 900 GB/s per GPU bidirectional,
  so 450 GB/s each way; one 400 Gb/s InfiniBand NIC per GPU (ConnectX-7), 50 GB/s each way;
  8 GPUs per node.
- K3's MoE layer: hidden 7168, expert FFN 2048 (SwiGLU: three H x F matrices, 6 H F FLOPs per pair),
  896 experts, top-16, bf16 activations and weights; 4096 tokens per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3sys.ep import baselines
from k3sys.ep.baselines import Placement
from k3sys.ep.planner import plan
from k3sys.ep.routing import balancedness, make_routing, tokens_per_expert
from k3sys.ep.routing import maxvio as _maxvio_of

__all__ = ["H200", "K3_MOE", "Comparison", "Hardware", "MoEShape", "StepCost", "compare", "pad_experts", "step_cost"]


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


H200 = Hardware()
K3_MOE = MoEShape()


@dataclass(frozen=True)
class StepCost:
    """Seconds per rank `[R]` float64 for each part; `step` is the slowest rank's total."""

    compute: torch.Tensor
    all_to_all: torch.Tensor
    prefetch: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        return self.compute + self.all_to_all + self.prefetch

    @property
    def step(self) -> float:
        return float(self.total.max())


def _link_seconds(bytes_sd: torch.Tensor, hw: Hardware) -> torch.Tensor:
    """`[R]` seconds to move `[R, R]` bytes (source, destination): per rank, the larger of its send and
    receive times, NVLink and network in parallel; a rank's bytes to itself stay local."""
    R = bytes_sd.shape[0]
    node = torch.arange(R) // hw.ranks_per_node
    same = node.view(R, 1) == node.view(1, R)
    off = ~torch.eye(R, dtype=torch.bool)
    intra = torch.where(same & off, bytes_sd, 0.0)
    inter = torch.where(~same, bytes_sd, 0.0)
    send = torch.maximum(intra.sum(1) / hw.nvlink_bytes_per_s, inter.sum(1) / hw.network_bytes_per_s)
    recv = torch.maximum(intra.sum(0) / hw.nvlink_bytes_per_s, inter.sum(0) / hw.network_bytes_per_s)
    return torch.maximum(send, recv)


def step_cost(p: Placement, shape: MoEShape = K3_MOE, hw: Hardware = H200) -> StepCost:
    """Per-rank time of one forward MoE layer step under placement `p`."""
    compute = p.loads.double() * shape.flops_per_pair / (hw.peak_flops * hw.gemm_efficiency)
    token_bytes = p.traffic.double() * shape.hidden * shape.bytes_per_elem
    # Combine sends the same rows back, so it costs what dispatch costs.
    a2a = 2 * _link_seconds(token_bytes, hw)
    prefetch = _link_seconds(p.fetched.double() * shape.expert_bytes, hw)
    return StepCost(compute, a2a, prefetch)


def pad_experts(tpe: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """`[R, ceil(E/R) * R]`: tpe with zero-load columns so every rank has ceil(E/R) expert slots.

    E = 896 over R = 256 ranks is 3.5 experts per rank: ranks 0, 2, 4, ... hold 4 real experts, the
    others 3 real and one empty slot (real experts stay in order).
    """
    R_src, E = tpe.shape
    per = -(-E // num_ranks)
    real = torch.full((num_ranks,), E // num_ranks)
    extra = E % num_ranks
    real[torch.arange(extra) * num_ranks // max(extra, 1)] += 1  # spread the fuller ranks evenly
    first = torch.cumsum(real, 0) - real
    col = torch.repeat_interleave(torch.arange(num_ranks) * per - first, real) + torch.arange(E)
    out = tpe.new_zeros(R_src, num_ranks * per)
    out[:, col] = tpe
    return out


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
    tolerance: float = 0.05,
    seed: int = 0,
    dist: str = "lognormal",
    shape: MoEShape = K3_MOE,
    hw: Hardware = H200,
) -> Comparison:
    """K3-scale balance at one maxvio: every method's step time against perfect balance.

    The routing has `dist` preferences ("lognormal" or "zipf") skewed to `maxvio`. Methods:
    "static"; "eplb", planned from a past step of the same preferences (before hot_shift moved
    them); "capacity" (factor `capacity_factor`); "greedy" (MoonEP's planner); "ours" (exact caps);
    "ours_node" (exact, node-aware); "ours_tol" (node-aware, loads within 1 + `tolerance` of the
    cap). Figures: step_ms, relative (to perfect balance), compute_ms, all_to_all_ms and prefetch_ms
    of the slowest rank, balancedness, peak_rows (largest rank's pairs / (s*K)), dropped_pct; for
    the planners also copies, moved_tokens and lower_bound (sum over ranks of the home load above
    the limit).
    """
    R, E, K, s = num_ranks, num_experts, top_k, tokens_per_rank
    now = tokens_per_expert(make_routing(R, s, E, K, maxvio, seed=seed, hot_shift=hot_shift, dist=dist), E)
    past = tokens_per_expert(make_routing(R, s, E, K, maxvio, seed=seed, step=1, dist=dist), E).sum(0)
    padded = pad_experts(now, R)
    methods: dict[str, Placement] = {
        "static": baselines.static(padded),
        "eplb": baselines.eplb(now, past, 2 * padded.shape[1] // R),
        "capacity": baselines.capacity(padded, K, capacity_factor),
    }
    plans = {
        "greedy": plan(padded, K, strategy="greedy"),
        "ours": plan(padded, K),
        "ours_node": plan(padded, K, ranks_per_node=hw.ranks_per_node),
        "ours_tol": plan(padded, K, tolerance=tolerance, ranks_per_node=hw.ranks_per_node),
    }
    methods |= {name: baselines.from_plan(p) for name, p in plans.items()}
    ideal = step_cost(_perfect(R, s, K), shape, hw).step
    out = {}
    for name, placement in methods.items():
        cost = step_cost(placement, shape, hw)
        slowest = int(cost.total.argmax())
        out[name] = {
            "step_ms": 1e3 * cost.step,
            "relative": cost.step / ideal,
            "compute_ms": 1e3 * float(cost.compute[slowest]),
            "all_to_all_ms": 1e3 * float(cost.all_to_all[slowest]),
            "prefetch_ms": 1e3 * float(cost.prefetch[slowest]),
            "balancedness": balancedness(placement.loads),
            "peak_rows": float(placement.loads.max()) / (s * K),
            "dropped_pct": 100.0 * placement.dropped / (R * s * K),
        }
    for name, p in plans.items():
        out[name] |= {"copies": p.num_copies, "moved_tokens": p.moved_tokens, "lower_bound": p.moved_lower_bound}
    return Comparison(maxvio=_maxvio_of(now.sum(0)), methods=out, tpe=padded)
