"""Expert parallelism with dynamic redundant experts: routings, the online planner, baselines, simulator."""

from k3sys.ep.planner import Plan, plan
from k3sys.ep.routing import balancedness, make_routing, maxvio, tokens_per_expert

__all__ = ["Plan", "balancedness", "make_routing", "maxvio", "plan", "tokens_per_expert"]
