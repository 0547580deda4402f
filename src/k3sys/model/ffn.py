"""Feed-forward blocks: the dense SwiGLU and the MoE FFN built on `k3sys.ep.MoELayer`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`: x `[..., D]` -> `[..., D]`, hidden width `ffn_size`."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
