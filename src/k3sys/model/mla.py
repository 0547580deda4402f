"""Gated multi-head latent attention (MLA) with a latent KV cache and absorbed decode.

Shapes: B batch, T new tokens, L tokens in the cache (past + new), H heads, D hidden,
r kv_lora_rank, dr rope dim, dn NoPE dim, dv value dim.

Per token the cache holds `[c_kv | k_rope]` (r + dr values): the RMS-normalised KV latent and the
decoupled rope key shared by all heads. Keys and values are `k_nope = W_uk c`, `v = W_uv c`, so
    q_nope . k_nope = (W_uk^T q_nope) . c      and      sum_l p_l v_l = W_uv (sum_l p_l c_l):
decode multiplies the up-projections into the query and the output once per step instead of
re-expanding the whole cache (DeepSeek-V2's "absorb" trick). Prefill without a past uses the
expanded form, which is cheaper when T is large.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from k3sys.kda.cp import cp_lengths, gather_sequence
from k3sys.model.cache import LatentKV


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on the last dim (even, split-half layout). x `[B, T, ..., d]`, positions `[T]`."""
    d, dt = x.shape[-1], torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=dt) / d)
    angles = positions.to(dt)[:, None] * inv_freq  # [T, d/2]
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (d // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    x1, x2 = x.to(dt).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class GatedMLA(nn.Module):
    """MLA with a per-head sigmoid output gate computed from the layer input.

    Args:
        hidden_size: D.
        num_heads: H.
        kv_lora_rank: r, width of the cached KV latent.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: dn, dr, dv.
        q_lora_rank: low-rank query bottleneck, or None for a full-rank query projection.
        use_rope: rotate the dr slice (False = NoPE, as Kimi Linear; the slice is still learnt).
        rope_theta: rotary base.
        norm_eps: epsilon of the RMSNorms on the query and KV latents.
        gated: the sigmoid output gate (`g_proj`); False is plain MLA (Kimi Linear's).
    """

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None,
                 use_rope: bool = False, rope_theta: float = 10000.0, norm_eps: float = 1e-5,
                 gated: bool = True) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.dn, self.dr, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.use_rope, self.rope_theta = use_rope, rope_theta
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        q_out = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_out, bias=False)
        else:
            self.q_proj = nn.Sequential(nn.Linear(hidden_size, q_lora_rank, bias=False),
                                        nn.RMSNorm(q_lora_rank, eps=norm_eps),
                                        nn.Linear(q_lora_rank, q_out, bias=False))
        self.kv_a_proj = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.g_proj = nn.Linear(hidden_size, num_heads * v_head_dim, bias=False) if gated else None
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What the cache stores for x `[B, T, D]`: `[c_kv | k_rope]` `[B, T, r + dr]`."""
        c, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.dr], dim=-1)
        if self.use_rope:
            k_rope = rotate(k_rope, positions, self.rope_theta)
        return torch.cat((self.kv_a_norm(c), k_rope), dim=-1)

    def forward(self, x: torch.Tensor, cache: LatentKV | None = None,
                cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """x `[B, T, D]` -> `[B, T, D]`, causal. With `cache`, x follows its `length` tokens and is appended.

        With `cp_group` (no cache), x is this rank's slice of a sequence split over the group in rank order:
        the latent KV is all-gathered and the slice attends to everything before it.
        """
        B, T, _ = x.shape
        past = cache.length if cache is not None else 0
        if cp_group is not None:
            lengths = cp_lengths(T, cp_group, x.device)
            past = sum(lengths[:dist.get_rank(cp_group)])
        positions = torch.arange(past, past + T, device=x.device)
        q = self.q_proj(x).view(B, T, self.num_heads, self.dn + self.dr)
        if self.use_rope:
            q = torch.cat((q[..., :self.dn], rotate(q[..., self.dn:], positions, self.rope_theta)), dim=-1)
        kv = self.latent(x, positions)
        if cache is not None:
            kv = cache.append(kv).to(x.dtype)  # a no-op unless the cache is stored narrower than the model
        elif cp_group is not None:
            kv = gather_sequence(kv, lengths, cp_group)[:, :past + T]
        o = self._expanded(q, kv) if past == 0 else self._absorbed(q, kv, past)
        o = o.reshape(B, T, -1)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)) if self.g_proj is not None else o)

    def _expanded(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Causal attention over freshly expanded keys/values. q `[B, T, H, dn+dr]`, kv `[B, T, r+dr]`."""
        B, T, H, _ = q.shape
        c, k_rope = kv.split([self.kv_lora_rank, self.dr], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(B, T, H, self.dn + self.dv).split([self.dn, self.dv], dim=-1)
        k = torch.cat((k_nope, k_rope[:, :, None].expand(B, T, H, self.dr)), dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=self.scale)
        return o.transpose(1, 2)  # [B, T, H, dv]

    def _absorbed(self, q: torch.Tensor, kv: torch.Tensor, past: int) -> torch.Tensor:
        """Attention in latent space over the whole cache. q `[B, T, H, dn+dr]`, kv `[B, L, r+dr]`."""
        B, T, H, _ = q.shape
        L = kv.shape[1]
        w = self.kv_b_proj.weight.view(H, self.dn + self.dv, self.kv_lora_rank)
        w_uk, w_uv = w[:, :self.dn], w[:, self.dn:]  # [H, dn, r], [H, dv, r]
        q_lat = torch.einsum("bthn,hnr->bhtr", q[..., :self.dn], w_uk)
        # Heads fold into rows so one batched matmul scores every head against the shared cache.
        q_cat = torch.cat((q_lat, q[..., self.dn:].transpose(1, 2)), dim=-1).reshape(B, H * T, -1)
        scores = torch.bmm(q_cat, kv.transpose(1, 2)).view(B, H, T, L)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * self.scale  # softmax in >= fp32
        if T > 1:
            key_pos = torch.arange(L, device=q.device)
            query_pos = torch.arange(past, past + T, device=q.device)
            scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        p = scores.softmax(dim=-1).to(kv.dtype).view(B, H * T, L)
        o_lat = torch.bmm(p, kv[..., :self.kv_lora_rank]).view(B, H, T, self.kv_lora_rank)
        return torch.einsum("bhtr,hvr->bthv", o_lat, w_uv)
