"""The hybrid decoder tying the designs together: KDA + gated MLA layers (3:1), MoE FFNs, a decode
cache whose bytes are exact, greedy/sampled generation, and the K3 memory calculator."""

from k3sys.model.cache import HybridCache, LatentKV, cache_bytes, layer_cache_bytes
from k3sys.model.checkpoint import load_model, save_model
from k3sys.model.config import PRESETS, ModelConfig, hybrid_layers
from k3sys.model.ffn import MoEFFN
from k3sys.model.generate import generate
from k3sys.model.mla import GatedMLA
from k3sys.model.model import Block, HybridModel
from k3sys.model.params import count_params

__all__ = [
    "PRESETS",
    "Block",
    "GatedMLA",
    "HybridCache",
    "HybridModel",
    "LatentKV",
    "ModelConfig",
    "MoEFFN",
    "cache_bytes",
    "count_params",
    "generate",
    "hybrid_layers",
    "layer_cache_bytes",
    "load_model",
    "save_model",
]
