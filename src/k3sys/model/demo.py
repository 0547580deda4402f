"""`k3sys demo` part "Model": prefill + 32 greedy tokens on the tiny hybrid model with its cache
breakdown, checked against full forwards, and the K3 memory table at up to 1M tokens."""

from __future__ import annotations

import time

import torch
from rich.progress import Progress

from k3sys.model.cache import HybridCache
from k3sys.model.config import ModelConfig
from k3sys.model.memory import format_bytes, memory_rows, memory_table
from k3sys.model.model import HybridModel

PROMPT_LEN, NEW_TOKENS = 64, 32


def demo(progress: Progress) -> list[tuple[str, str]]:
    task = progress.add_task("model: prefill + decode (tiny)", total=NEW_TOKENS + 1)
    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    model = HybridModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN))
    cache = HybridCache(cfg, batch=1, max_len=PROMPT_LEN + NEW_TOKENS)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids, cache, logits_to_keep=1)[:, -1]
        prefill_s = time.perf_counter() - t0
        progress.advance(task)
        t0 = time.perf_counter()
        for _ in range(NEW_TOKENS):
            ids = torch.cat((ids, logits.argmax(-1, keepdim=True)), dim=1)
            logits = model(ids[:, -1:], cache)[:, -1]
            progress.advance(task)
        decode_s = time.perf_counter() - t0
        # The same tokens from one full forward over the whole sequence: decode on the cache is exact.
        full = model(ids)[:, PROMPT_LEN - 1:-1].argmax(-1)
    matches = torch.equal(full, ids[:, PROMPT_LEN:])

    b = cache.breakdown()
    k3 = ModelConfig.from_preset("k3")
    progress.console.print(memory_table(k3))
    at_1m = memory_rows(k3, (1 << 20,))[0]
    return [
        ("tiny: prefill 64 tokens", f"{prefill_s * 1e3:.1f} ms"),
        ("tiny: decode", f"{decode_s / NEW_TOKENS * 1e3:.2f} ms/token x {NEW_TOKENS}"),
        ("tiny: decoded == full-forward tokens", "yes" if matches else "NO"),
        ("tiny: cache (KDA state / MLA latent)",
         f"{format_bytes(b['kda'])} / {format_bytes(b['mla'])} for {cache.capacity} tokens"),
        ("K3 cache @1M tokens, bf16", f"{format_bytes(at_1m.hybrid)} ({format_bytes(at_1m.kda)} KDA)"),
        ("K3 @1M: all-MLA / all-MHA",
         f"{at_1m.all_mla / at_1m.hybrid:.2f}x / {at_1m.all_mha / at_1m.hybrid:.0f}x more"),
    ]
