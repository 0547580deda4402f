"""Expert parallelism with dynamic redundant experts: routings, the online planner, baselines, simulator.

Exports load on first use, so `k3sys ep ...` and the rest of the CLI start without importing torch
(a sandbox-only install has none).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3sys.ep.planner import Plan, plan
    from k3sys.ep.routing import balancedness, make_routing, maxvio, tokens_per_expert

_EXPORTS = {
    "Plan": "planner", "plan": "planner",
    "balancedness": "routing", "make_routing": "routing", "maxvio": "routing", "tokens_per_expert": "routing",
}
__all__ = ["Plan", "balancedness", "make_routing", "maxvio", "plan", "tokens_per_expert"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'k3sys.ep' has no attribute {name!r}")
    return getattr(import_module(f"k3sys.ep.{_EXPORTS[name]}"), name)
