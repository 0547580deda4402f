"""`HybridModel`: embedding, pre-norm blocks (KDA or gated MLA, then a dense or MoE FFN), final
norm, LM head. One forward serves training-style full sequences, prefill and decode: given a
`HybridCache` it continues from the cached tokens and appends to it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from k3sys.kda import KimiDeltaAttention
from k3sys.model.cache import HybridCache
from k3sys.model.config import ModelConfig
from k3sys.model.ffn import build_ffn
from k3sys.model.hf import load_pretrained
from k3sys.model.mla import GatedMLA


def build_attention(cfg: ModelConfig, kind: str) -> nn.Module:
    """The token mixer of a layer of `kind` ("kda" or "mla")."""
    if kind == "kda":
        return KimiDeltaAttention(cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim,
                                  conv_size=cfg.kda_conv_size, lower_bound=cfg.kda_lower_bound,
                                  norm_eps=cfg.norm_eps, output_gate_bias=cfg.kda_output_gate_bias)
    return GatedMLA(cfg.hidden_size, cfg.mla_num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                    cfg.qk_rope_head_dim, cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
                    use_rope=cfg.mla_use_rope, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
                    gated=cfg.mla_output_gate)


class Block(nn.Module):
    """Pre-norm residual block: `x + attn(norm(x))`, then `x + ffn(norm(x))`."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index, self.kind = index, cfg.layers[index]
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = build_attention(cfg, self.kind)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ffn = build_ffn(cfg, moe=cfg.is_moe_layer(index))

    def forward(self, x: torch.Tensor, cache: HybridCache | None = None,
                cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        h = self.attn_norm(x)
        if self.kind == "kda":
            # With a cache, the layer writes into its preallocated buffers (the decode step updates S in
            # place), so the cache's storage stays where it was allocated and no state is copied.
            state = cache.layers[self.index] if cache is not None else None
            h, _ = self.attn(h, state=state, cp_group=cp_group, inplace=cache is not None)
        else:
            h = self.attn(h, cache.layers[self.index] if cache is not None else None, cp_group=cp_group)
        x = x + h
        return x + self.ffn(self.ffn_norm(x))


class HybridModel(nn.Module):
    """Decoder-only LM: `logits [B, T, vocab] = model(ids [B, T], cache=None)`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> HybridModel:
        """The model of a Kimi-Linear-style Hugging Face checkpoint directory, weights loaded (`k3sys.model.hf`)."""
        return load_pretrained(cls, path, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor, cache: HybridCache | None = None, logits_to_keep: int = 0,
                cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """ids `[B, T]` int64 -> logits `[B, T, vocab]`. With `cache`, ids continue the cached tokens.
        With `cp_group` (no cache), ids are this rank's slice of sequences split over the group in rank
        order (context parallel prefill, k3sys.kda.cp): the logits of this slice.

        `logits_to_keep` n > 0 returns the logits of the last n positions only, `[B, n, vocab]` (as in
        Hugging Face models): a prefill for generation needs one row, not T rows of the vocabulary.
        """
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32) or ids.shape[1] == 0:
            raise ValueError(f"ids must be a non-empty int32/int64 tensor [B, T], got {ids.dtype} {list(ids.shape)}")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        if cache is not None and cp_group is not None:
            raise ValueError("a context-parallel forward takes no cache (decode after it is not supported yet)")
        if cache is not None:
            cache.check_room(ids.shape[0], ids.shape[1])
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cache, cp_group)
        if cache is not None:
            cache.seq_len += ids.shape[1]
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.lm_head(self.norm(x))
