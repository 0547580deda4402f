"""Decode cost and cache bytes vs context length: hybrid (3 KDA : 1 MLA) against all-MLA and all-KDA.

Claim: a KDA layer's decode state is fixed, an MLA layer's latent cache grows with the context, so
the hybrid's cache grows at 1/4 of all-MLA's slope, all-KDA stays flat, and decode time follows.

Three models of the same size (8 layers, hidden 512, KDA 8 heads x 64, MLA 8 heads with a 128 + 32
latent, dense SwiGLU FFNs so MoE routing noise stays out of the comparison) decode one token at a
time on CPU in fp32, batch 1, one thread, after a context of 1K / 8K / 32K tokens; the median of
20 steps after 3 warm-up steps.

The context is staged, not prefilled: every MLA cache is filled with random latents and every KDA
state with random values of the right shapes, and the cache is told it holds that many tokens.
Decode cost depends only on those shapes (the attention reads the whole latent cache either way),
and prefilling 32K tokens through three models on this CPU would take far longer than the claim needs.

Cache bytes are `HybridCache.nbytes()`: exact allocated bytes, checked against tensor storage in the
tests. Output: a table with ratios to all-MLA, bench/results/model_decode.json and model_decode.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from k3sys.model import HybridCache, HybridModel, LatentKV, ModelConfig, hybrid_layers
from k3sys.model.memory import format_bytes, format_tokens

RESULTS = Path(__file__).parent / "results"
VARIANTS = {"hybrid": hybrid_layers(8, 3), "all-MLA": ("mla",) * 8, "all-KDA": ("kda",) * 8}


def bench_config(layers: tuple[str, ...]) -> ModelConfig:
    return ModelConfig(
        name="bench", vocab_size=1024, hidden_size=512, layers=layers, kda_num_heads=8, kda_head_dim=64,
        mla_num_heads=8, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        first_dense_layers=8, dense_ffn_size=1024, max_context=1 << 16,
    )


def staged_cache(cfg: ModelConfig, context: int, steps: int, generator: torch.Generator) -> HybridCache:
    """A cache holding `context` tokens of random latents / states, with room for `steps` more."""
    cache = HybridCache(cfg, batch=1, max_len=context + steps)
    for entry in cache.layers:
        if isinstance(entry, LatentKV):
            entry.append(torch.randn(1, context, entry.buf.shape[2], generator=generator))
        else:
            entry.conv.normal_(generator=generator)
            entry.recurrent.normal_(std=0.1, generator=generator)
    cache.seq_len = context
    return cache


def decode_ms(model: HybridModel, cache: HybridCache, steps: int, warmup: int) -> float:
    """Median wall time of one decode step (one token through the whole model), in ms."""
    token = torch.zeros(1, 1, dtype=torch.int64)
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            token = model(token, cache)[:, -1:].argmax(-1)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1 << 10, 8 << 10, 32 << 10])
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    ap.add_argument("--warmup", type=int, default=3)
    # Batch-1 decode is a chain of small ops: one thread is as fast and keeps a shared machine's noise out.
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, layers in VARIANTS.items():
        cfg = bench_config(layers)
        model = HybridModel(cfg).eval()
        for context in args.contexts:
            cache = staged_cache(cfg, context, args.warmup + args.steps, gen)
            nbytes = cache.breakdown()
            ms = decode_ms(model, cache, args.steps, args.warmup)
            results.append({"variant": name, "context": context, "ms_per_token": ms, "cache_bytes": nbytes["total"],
                            "kda_bytes": nbytes["kda"], "mla_bytes": nbytes["mla"]})
            del cache

    base = {r["context"]: r for r in results if r["variant"] == "all-MLA"}
    table = Table(title="Decode on a staged context: 8 layers, hidden 512, fp32, batch 1, CPU "
                        f"(threads={torch.get_num_threads()}); ratios vs all-MLA")
    for col in ("variant", "context", "ms/token", "cache", "time ratio", "bytes ratio"):
        table.add_column(col, justify="right")
    for r in results:
        b = base[r["context"]]
        table.add_row(r["variant"], format_tokens(r["context"]), f"{r['ms_per_token']:.2f}",
                      format_bytes(r["cache_bytes"]), f"{r['ms_per_token'] / b['ms_per_token']:.2f}x",
                      f"{r['cache_bytes'] / b['cache_bytes']:.3f}x")
    Console().print(table)

    RESULTS.mkdir(exist_ok=True)
    meta = {"layers": {k: list(v) for k, v in VARIANTS.items()}, "config": bench_config(VARIANTS["hybrid"]).to_dict(),
            "steps": args.steps, "warmup": args.warmup, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "context": "staged with random latents/states (no prefill)"}
    (RESULTS / "model_decode.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    plot(results, RESULTS / "model_decode.png")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for name in VARIANTS:
        rows = [r for r in results if r["variant"] == name]
        ctx = [r["context"] for r in rows]
        ax_b.plot(ctx, [r["cache_bytes"] / 2**20 for r in rows], marker="o", label=name)
        ax_t.plot(ctx, [r["ms_per_token"] for r in rows], marker="o", label=name)
    for ax, ylabel in ((ax_b, "decode cache (MiB)"), (ax_t, "decode time (ms / token)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("8-layer hybrid (3 KDA : 1 MLA) vs all-MLA vs all-KDA, hidden 512, CPU fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
