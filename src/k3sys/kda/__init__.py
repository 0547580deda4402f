"""Kimi Delta Attention: a fixed-size recurrent state with per-channel decay and a delta-rule update."""

from k3sys.kda.gate import kda_gate
from k3sys.kda.naive import kda_naive

__all__ = ["kda_gate", "kda_naive"]
