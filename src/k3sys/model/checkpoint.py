"""Save and load `HybridModel` weights as safetensors, with the config in the file's metadata."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3sys.model.config import ModelConfig
from k3sys.model.model import HybridModel

_CONFIG_KEY = "k3sys.model.config"


def save_model(model: HybridModel, path: str | Path) -> None:
    """Write every parameter and buffer of `model` plus its config (JSON metadata) to `path`."""
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(path), metadata={_CONFIG_KEY: json.dumps(model.cfg.to_dict())})


def load_model(path: str | Path, device: torch.device | str = "cpu") -> HybridModel:
    """Rebuild the model saved by `save_model` and load its weights (strict: every name must match)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if _CONFIG_KEY not in meta:
        raise ValueError(f"{path} has no {_CONFIG_KEY!r} metadata; was it written by save_model?")
    with torch.device(device):
        model = HybridModel(ModelConfig.from_dict(json.loads(meta[_CONFIG_KEY])))
    model.load_state_dict(load_file(str(path), device=str(device)), strict=True)
    return model
