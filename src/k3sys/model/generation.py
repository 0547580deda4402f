"""Autoregressive generation: one prefill over the prompt, then one token per step on the cache."""

from __future__ import annotations

import torch

from k3sys.model.cache import HybridCache
from k3sys.model.model import HybridModel


@torch.no_grad()
def generate(model: HybridModel, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             generator: torch.Generator | None = None, cache: HybridCache | None = None) -> torch.Tensor:
    """Continue `prompt_ids` `[B, T]` by `max_new_tokens` tokens; returns `[B, T + max_new_tokens]`.

    Prefill runs the whole prompt at once (chunked KDA, expanded MLA attention); each decode step
    feeds one token (KDA step on the fixed state, absorbed MLA over the latent cache).
    `temperature` 0 is greedy; above 0 samples from `softmax(logits / temperature)` with `generator`.
    `cache` (optional, empty) is filled in place, so callers can inspect it afterwards; by default
    one is allocated at exactly `T + max_new_tokens` tokens in the model's dtype.
    """
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [B, T] with T >= 1, got shape {list(prompt_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    B, T = prompt_ids.shape
    if T + max_new_tokens > model.cfg.max_context:
        raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_context {model.cfg.max_context}")
    if cache is None:
        param = next(model.parameters())
        cache = HybridCache(model.cfg, B, max_len=T + max_new_tokens, dtype=param.dtype, device=param.device)
    elif cache.seq_len != 0:
        raise ValueError(f"cache must be empty, it already holds {cache.seq_len} tokens")
    out = [prompt_ids]
    ids = prompt_ids
    for _ in range(max_new_tokens):
        logits = model(ids, cache, logits_to_keep=1)[:, -1].float()
        if temperature == 0:
            ids = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            ids = torch.multinomial(probs, 1, generator=generator)
        out.append(ids)
    return torch.cat(out, dim=1)
