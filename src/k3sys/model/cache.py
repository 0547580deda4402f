"""Decode caches and their byte arithmetic.

`layer_cache_bytes` is the one formula for what a layer keeps per sequence; `cache_bytes` (the
memory calculator) and `HybridCache.breakdown()` both call it, and tests check it against the
storage of the tensors `HybridCache` really allocates.

- KDA layer: a fixed-size state, whatever the context length: the recurrent S `[B, H, K, K]` in
  fp32 (fp64 in an fp64 cache) plus the short-convolution tails of q, k, v
  `[B, conv - 1, 3 * H * K]` in the cache dtype.
- MLA layer: `[c_kv | k_rope]` per token, `kv_lora_rank + qk_rope_head_dim` values in the cache dtype.
- "mha" (a baseline, not a layer this package builds): full per-head keys and values,
  `H * (qk_nope + qk_rope + v)` values per token.
"""

from __future__ import annotations

import torch

from k3sys.kda import KDAState
from k3sys.model.config import ModelConfig

CACHE_KINDS = ("kda", "mla", "mha")


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the KDA recurrent state in a cache of `dtype`: fp32 (fp64 in an fp64 cache), as the layer has it."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kda_state(cfg: ModelConfig, batch: int, dtype: torch.dtype, device: torch.device | str | None) -> KDAState:
    return KDAState.zeros(batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size,
                          conv_dtype=dtype, recurrent_dtype=state_dtype(dtype), device=device)


def layer_cache_bytes(cfg: ModelConfig, kind: str, tokens: int, batch: int = 1,
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one layer of `kind` keeps for `batch` sequences holding `tokens` tokens."""
    if tokens < 0 or batch < 1:
        raise ValueError(f"need tokens >= 0 and batch >= 1, got tokens={tokens}, batch={batch}")
    item = dtype.itemsize
    if kind == "kda":
        return _kda_state(cfg, batch, dtype, device="meta").nbytes()  # the very state HybridCache allocates
    if kind == "mla":
        return batch * tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item
    if kind == "mha":
        return batch * tokens * cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * item
    raise ValueError(f"kind must be one of {list(CACHE_KINDS)}, got {kind!r}")


def cache_bytes(cfg: ModelConfig, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16,
                layers: tuple[str, ...] | None = None) -> dict[str, int]:
    """Decode-cache bytes of `batch` sequences of `context_len` tokens, by kind, plus "total".

    `layers` overrides `cfg.layers` (e.g. `("mla",) * n` or `("mha",) * n` for the comparisons).
    """
    layers = cfg.layers if layers is None else layers
    out = {kind: 0 for kind in ("kda", "mla")}
    for kind in layers:
        out[kind] = out.get(kind, 0) + layer_cache_bytes(cfg, kind, context_len, batch, dtype)
    out["total"] = sum(out.values())
    return out


class LatentKV:
    """One MLA layer's cache: `[c_kv | k_rope]` per token in a buffer `[B, capacity, width]`.

    With `max_len` the buffer is allocated once at that size. Without, it grows geometrically in
    whole blocks of `block_size` tokens, so appending a token costs amortised O(1) copies.
    """

    def __init__(self, batch: int, width: int, dtype: torch.dtype, device: torch.device | str | None = None,
                 max_len: int | None = None, block_size: int = 256) -> None:
        self.max_len, self.block_size = max_len, block_size
        self.length = 0
        self.buf = torch.empty(batch, max_len or 0, width, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.buf.shape[1]

    def append(self, kv: torch.Tensor) -> torch.Tensor:
        """Append kv `[B, T, width]`; return the cached tokens so far `[B, length, width]` (a view)."""
        end = self.length + kv.shape[1]
        if end > self.capacity:
            if self.max_len is not None:
                raise ValueError(f"cache is full: max_len={self.max_len}, appending {kv.shape[1]} "
                                 f"tokens to {self.length}")
            blocks = -(-max(end, 2 * self.capacity) // self.block_size)
            grown = self.buf.new_empty(self.buf.shape[0], blocks * self.block_size, self.buf.shape[2])
            grown[:, :self.length] = self.buf[:, :self.length]
            self.buf = grown
        self.buf[:, self.length:end] = kv
        self.length = end
        return self.buf[:, :end]


class HybridCache:
    """Everything `HybridModel` needs to continue `batch` sequences: per layer either a KDA state
    (fixed size) or a `LatentKV` (grows with the context).

    Args:
        cfg: the model's config.
        batch: number of sequences B.
        max_len: allocate every MLA cache at this many tokens up front (and refuse to grow past
            it); None grows the caches in blocks of `block_size` tokens as tokens arrive.
        dtype: storage dtype of the MLA latents and the KDA conv tails (KDA's S stays fp32, fp64
            in an fp64 cache).
        device: where the cache lives.
        block_size: growth granule of the MLA caches, in tokens.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 block_size: int = 256) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if max_len is not None and not 1 <= max_len <= cfg.max_context:
            raise ValueError(f"max_len must be in [1, max_context={cfg.max_context}], got {max_len}")
        self.cfg, self.batch, self.max_len, self.dtype = cfg, batch, max_len, dtype
        self.seq_len = 0
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.layers: list[KDAState | LatentKV] = [
            _kda_state(cfg, batch, dtype, device) if kind == "kda"
            else LatentKV(batch, width, dtype, device, max_len=max_len, block_size=block_size)
            for kind in cfg.layers
        ]

    @property
    def capacity(self) -> int:
        """Tokens the MLA caches hold without growing (0 when the model has no MLA layer)."""
        return max((c.capacity for c in self.layers if isinstance(c, LatentKV)), default=0)

    def check_room(self, batch: int, new_tokens: int) -> None:
        """Raise ValueError unless `new_tokens` more tokens of `batch` sequences fit."""
        if batch != self.batch:
            raise ValueError(f"cache holds batch={self.batch} sequences, got ids for batch={batch}")
        limit = self.max_len or self.cfg.max_context
        if self.seq_len + new_tokens > limit:
            raise ValueError(f"{self.seq_len} cached + {new_tokens} new tokens exceed the cache limit {limit}")

    def breakdown(self) -> dict:
        """Allocated bytes: {"kda": int, "mla": int, "total": int, "layers": [(index, kind, bytes)]}."""
        layers = [(i, kind, layer_cache_bytes(self.cfg, kind, self.capacity, self.batch, self.dtype))
                  for i, kind in enumerate(self.cfg.layers)]
        out = {kind: sum(b for _, k, b in layers if k == kind) for kind in ("kda", "mla")}
        return {**out, "total": out["kda"] + out["mla"], "layers": layers}

    def nbytes(self) -> int:
        """Total allocated bytes (what `cache_bytes(cfg, self.capacity, ...)` predicts)."""
        return self.breakdown()["total"]
