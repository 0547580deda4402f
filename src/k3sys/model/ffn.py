"""Feed-forward blocks: a dense SwiGLU, or an MoE FFN around `k3sys.ep.MoELayer`."""

from __future__ import annotations

import torch
from torch import nn

from k3sys.ep import MoELayer
from k3sys.ep.layer import SwiGLU
from k3sys.model.config import ModelConfig


class MoEFFN(nn.Module):
    """Routed experts (optionally in a latent space) plus shared experts on the full hidden state.

    x `[..., D]` -> `down` (D -> latent, identity without a latent) -> `MoELayer` -> `up` (latent -> D),
    plus `shared(x)`, a SwiGLU of width `num_shared_experts * expert_ffn_size` every token goes through.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, latent = cfg.hidden_size, cfg.moe_latent_size
        self.down = nn.Linear(d, latent, bias=False) if latent else nn.Identity()
        self.experts = MoELayer(latent or d, cfg.expert_ffn_size, cfg.num_experts, cfg.top_k, router=cfg.router,
                                score_bias=cfg.router_score_bias, routed_scale=cfg.routed_scaling_factor)
        self.up = nn.Linear(latent, d, bias=False) if latent else nn.Identity()
        shared = cfg.num_shared_experts * cfg.expert_ffn_size
        self.shared = SwiGLU(d, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(self.experts(self.down(x)))
        return y + self.shared(x) if self.shared is not None else y

    def routed_expert_params(self) -> int:
        """Weights of all routed experts (a token uses top_k / num_experts of them)."""
        e = self.experts
        return e.w_gate.numel() + e.w_up.numel() + e.w_down.numel()


def build_ffn(cfg: ModelConfig, moe: bool) -> nn.Module:
    """The FFN of a layer: `MoEFFN` when `moe`, else a dense SwiGLU of `dense_ffn_size`."""
    return MoEFFN(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.dense_ffn_size)
