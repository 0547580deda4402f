"""The hybrid decoder tying the designs together: KDA + gated MLA layers (3:1), MoE FFNs, a decode
cache whose bytes are exact, greedy/sampled generation, and the K3 memory calculator.

Exports load on first use (`k3sys._lazy`), so the CLI starts without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3sys._lazy import lazy_exports

if TYPE_CHECKING:
    from k3sys.model.cache import HybridCache, LatentKV, cache_bytes, layer_cache_bytes
    from k3sys.model.checkpoint import load_model, save_model
    from k3sys.model.config import PRESETS, ModelConfig, hybrid_layers
    from k3sys.model.ffn import MoEFFN
    from k3sys.model.generation import generate
    from k3sys.model.mla import GatedMLA
    from k3sys.model.model import Block, HybridModel
    from k3sys.model.params import count_params

_EXPORTS = {
    "HybridCache": "cache", "LatentKV": "cache", "cache_bytes": "cache", "layer_cache_bytes": "cache",
    "load_model": "checkpoint", "save_model": "checkpoint",
    "PRESETS": "config", "ModelConfig": "config", "hybrid_layers": "config",
    "MoEFFN": "ffn", "generate": "generation", "GatedMLA": "mla", "Block": "model", "HybridModel": "model",
    "count_params": "params",
}
__all__ = [
    "PRESETS", "Block", "GatedMLA", "HybridCache", "HybridModel", "LatentKV", "ModelConfig", "MoEFFN", "cache_bytes",
    "count_params", "generate", "hybrid_layers", "layer_cache_bytes", "load_model", "save_model",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
