"""Expert parallelism with dynamic redundant experts: routings, the online planner, the runtime, the MoE layer."""

from k3sys.ep.comm import EPBuffer, EPHandle, RemoteInputError
from k3sys.ep.experts import grouped_mm, grouped_swiglu
from k3sys.ep.layer import MoELayer, MoEStats
from k3sys.ep.planner import Plan, plan
from k3sys.ep.routing import balancedness, make_routing, maxvio, tokens_per_expert

__all__ = [
    "EPBuffer", "EPHandle", "MoELayer", "MoEStats", "Plan", "RemoteInputError", "balancedness", "grouped_mm",
    "grouped_swiglu", "make_routing", "maxvio", "plan", "tokens_per_expert",
]
