"""Kimi Delta Attention: a fixed-size recurrent state with per-channel decay and a delta-rule update."""

from k3sys.kda.chunk import kda_chunk
from k3sys.kda.cp import kda_chunk_cp
from k3sys.kda.gate import kda_gate
from k3sys.kda.layer import KimiDeltaAttention
from k3sys.kda.naive import kda_naive
from k3sys.kda.state import KDAState, kda_state_bytes, kv_cache_bytes
from k3sys.kda.step import kda_step

__all__ = [
    "KDAState",
    "KimiDeltaAttention",
    "kda_chunk",
    "kda_chunk_cp",
    "kda_gate",
    "kda_naive",
    "kda_state_bytes",
    "kda_step",
    "kv_cache_bytes",
]
