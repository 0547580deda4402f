"""KDA's decode state: fixed-size, whatever the context length; and the KV cache it replaces."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KDAState:
    """One KDA layer's decode state for B sequences.

    conv: `[B, conv_size - 1, channels]` the last projected q/k/v inputs of the short convolution,
        oldest first (channels = 3 * H * head_dim), in the layer's (or cache's) dtype.
    recurrent: `[B, H, K, V]` the KDA state S, fp32 (fp64 for an fp64 layer).
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
    ) -> KDAState:
        """A fresh state (what a layer assumes when given None); `device="meta"` sizes it for free."""
        H, D = num_heads, head_dim
        return cls(conv=torch.zeros(batch, conv_size - 1, 3 * H * D, dtype=conv_dtype, device=device),
                   recurrent=torch.zeros(batch, H, D, D, dtype=recurrent_dtype, device=device))

    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def copy_(self, src: KDAState) -> KDAState:
        """Write `src` into this state's storage (e.g. a cache's preallocated buffers, casting); returns self."""
        for name in ("conv", "recurrent"):
            dst_t, src_t = getattr(self, name), getattr(src, name)
            if dst_t.shape != src_t.shape:
                raise ValueError(f"state.{name} shape mismatch: buffer {list(dst_t.shape)}, new {list(src_t.shape)}")
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
