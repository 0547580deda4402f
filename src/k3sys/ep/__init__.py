"""Expert parallelism with dynamic redundant experts: routings, the online planner, baselines, simulator,
the runtime (`EPBuffer`) and the MoE layer.

Exports load on first use, so `k3sys ep ...` and the rest of the CLI start without importing torch
(a sandbox-only install has none).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3sys.ep.comm import EPBuffer, EPHandle, RemoteInputError
    from k3sys.ep.experts import grouped_mm, grouped_swiglu
    from k3sys.ep.layer import MoELayer, MoEStats
    from k3sys.ep.planner import Plan, plan
    from k3sys.ep.routing import balancedness, make_routing, maxvio, tokens_per_expert

_EXPORTS = {
    "Plan": "planner", "plan": "planner",
    "balancedness": "routing", "make_routing": "routing", "maxvio": "routing", "tokens_per_expert": "routing",
    "EPBuffer": "comm", "EPHandle": "comm", "RemoteInputError": "comm",
    "grouped_mm": "experts", "grouped_swiglu": "experts",
    "MoELayer": "layer", "MoEStats": "layer",
}
__all__ = [
    "EPBuffer", "EPHandle", "MoELayer", "MoEStats", "Plan", "RemoteInputError", "balancedness", "grouped_mm",
    "grouped_swiglu", "make_routing", "maxvio", "plan", "tokens_per_expert",
]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'k3sys.ep' has no attribute {name!r}")
    return getattr(import_module(f"k3sys.ep.{_EXPORTS[name]}"), name)
