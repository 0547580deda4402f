"""Expert parallelism with dynamic redundant experts: routings, the online planner, baselines, simulator,
the runtime (`EPBuffer`) and the MoE layer.

Exports load on first use, so `k3sys ep ...` and the rest of the CLI start without importing torch
(a sandbox-only install has none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3sys._lazy import lazy_exports

if TYPE_CHECKING:
    from k3sys.ep.comm import EPBuffer, EPHandle, PendingDispatch, RemoteInputError, RemoteStepError
    from k3sys.ep.experts import grouped_mm, grouped_swiglu
    from k3sys.ep.layer import MoELayer, MoEStats
    from k3sys.ep.parallelize import ExpertParallelMoE, apply_ep
    from k3sys.ep.planner import Plan, plan
    from k3sys.ep.routing import balancedness, make_routing, maxvio, tokens_per_expert

_EXPORTS = {
    "Plan": "planner", "plan": "planner",
    "balancedness": "routing", "make_routing": "routing", "maxvio": "routing", "tokens_per_expert": "routing",
    "EPBuffer": "comm", "EPHandle": "comm", "PendingDispatch": "comm", "RemoteInputError": "comm",
    "RemoteStepError": "comm",
    "grouped_mm": "experts", "grouped_swiglu": "experts",
    "MoELayer": "layer", "MoEStats": "layer",
    "ExpertParallelMoE": "parallelize", "apply_ep": "parallelize",
}
__all__ = [
    "EPBuffer", "EPHandle", "ExpertParallelMoE", "MoELayer", "MoEStats", "PendingDispatch", "Plan", "RemoteInputError",
    "RemoteStepError", "apply_ep", "balancedness", "grouped_mm", "grouped_swiglu", "make_routing", "maxvio", "plan",
    "tokens_per_expert",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
