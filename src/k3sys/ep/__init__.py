"""Expert parallelism with dynamic redundant experts (MoonEP-style): planner, runtime, MoE layer."""

from k3sys.ep.experts import grouped_mm, grouped_swiglu
from k3sys.ep.layer import MoELayer, MoEStats

__all__ = ["MoELayer", "MoEStats", "grouped_mm", "grouped_swiglu"]
