"""Parameter counts of a config, total and active per token, without allocating any weights."""

from __future__ import annotations

import torch

from k3sys.model.config import ModelConfig
from k3sys.model.model import Block


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """{"total": int, "active": int}: every weight, and those one token touches.

    Each distinct block (attention kind x dense/MoE FFN) is built once on the meta device and its
    parameters counted, so the count follows the modules exactly. Active = total minus the routed
    experts a token is not sent to, `(num_experts - top_k) / num_experts` of them per MoE layer.
    Embedding and LM head (untied) count in both.
    """
    per_block: dict[tuple[str, bool], tuple[int, int]] = {}
    total = 2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size  # embedding, LM head, final norm
    active = total
    with torch.device("meta"):
        for i, kind in enumerate(cfg.layers):
            key = (kind, cfg.is_moe_layer(i))
            if key not in per_block:
                block = Block(cfg, i)
                n = sum(p.numel() for p in block.parameters())
                routed = block.ffn.routed_expert_params() if key[1] else 0
                per_block[key] = (n, routed * (cfg.num_experts - cfg.top_k) // cfg.num_experts if routed else 0)
            n, idle = per_block[key]
            total += n
            active += n - idle
    return {"total": total, "active": active}
