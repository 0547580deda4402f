"""KDA's decode state: fixed-size, whatever the context length; and the KV cache it replaces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# "kv": S is [K, V] per head (ours, o = S^T q); "vk": [V, K] (fla's state_v_first, FlashKDA's oracle).
STATE_LAYOUTS = ("kv", "vk")


@dataclass(frozen=True)
class KDAState:
    """One KDA layer's decode state for B sequences.

    conv: `[B, conv_size - 1, channels]` the last projected q/k/v inputs of the short convolution,
        oldest first (channels = 2 * H * K + HV * V), in the layer's (or cache's) dtype.
    recurrent: the KDA state S, `[B, HV, K, V]` (layout "kv", ours) or `[B, HV, V, K]` (layout "vk",
        fla's `state_v_first`), fp32 (fp64 for an fp64 layer). HV = V heads (= H without GVA).
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def zeros(
        cls,
        batch: int,
        num_heads: int,
        head_dim: int,
        conv_size: int = 4,
        conv_dtype: torch.dtype = torch.float32,
        recurrent_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        num_v_heads: int | None = None,
        head_v_dim: int | None = None,
        layout: str = "kv",
    ) -> KDAState:
        """A fresh state (what a layer assumes when given None); `device="meta"` sizes it for free.

        `num_v_heads` / `head_v_dim` default to `num_heads` / `head_dim`; `layout` is "kv" or "vk".
        """
        H, K = num_heads, head_dim
        HV, V = num_v_heads or H, head_v_dim or K
        if layout not in STATE_LAYOUTS:
            raise ValueError(f"layout must be one of {list(STATE_LAYOUTS)}, got {layout!r}")
        shape = (batch, HV, K, V) if layout == "kv" else (batch, HV, V, K)
        return cls(conv=torch.zeros(batch, conv_size - 1, 2 * H * K + HV * V, dtype=conv_dtype, device=device),
                   recurrent=torch.zeros(shape, dtype=recurrent_dtype, device=device))

    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def copy_(self, src: KDAState) -> KDAState:
        """Write `src` into this state's storage (e.g. a cache's preallocated buffers, casting); returns self."""
        for name in ("conv", "recurrent"):
            dst_t, src_t = getattr(self, name), getattr(src, name)
            if dst_t.shape != src_t.shape:
                raise ValueError(f"state.{name} shape mismatch: buffer {list(dst_t.shape)}, new {list(src_t.shape)}")
            if dst_t is not src_t:  # a step that updated this buffer in place has nothing to copy
                dst_t.copy_(src_t)
        return self


def kda_state_bytes(num_heads: int, head_dim: int, conv_size: int = 4, batch: int = 1,
                    conv_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one KDA layer's decode state (S in fp32, conv tails in `conv_dtype`), for any context length."""
    return KDAState.zeros(batch, num_heads, head_dim, conv_size, conv_dtype, device="meta").nbytes()


def kv_cache_bytes(num_heads: int, head_dim: int, tokens: int, batch: int = 1,
                   dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a full-attention layer's KV cache with the same heads after `tokens` tokens."""
    return 2 * batch * tokens * num_heads * head_dim * dtype.itemsize
