"""The memory calculator behind `k3sys memory`: decode-cache bytes of a config at several context
lengths, split KDA / MLA, beside the same model with every layer MLA and every layer plain MHA."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from rich import box
from rich.table import Table

from k3sys._units import format_bytes
from k3sys.model.cache import cache_bytes
from k3sys.model.config import ModelConfig
from k3sys.model.params import count_params

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
DEFAULT_CONTEXTS = (4 << 10, 128 << 10, 1 << 20)


def parse_tokens(text: str) -> int:
    """'4K' -> 4096, '128k' -> 131072, '1M' -> 1048576, '1000' -> 1000 (binary K and M)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"context must be a positive token count like 4096, 128K or 1M, got {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20}[m.group(2).lower()]


def format_tokens(n: int) -> str:
    for shift, unit in ((20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


@dataclass(frozen=True)
class MemoryRow:
    """Cache bytes per `batch` sequences at one context length."""

    context: int
    kda: int
    mla: int
    hybrid: int
    all_mla: int
    all_mha: int


def memory_rows(cfg: ModelConfig, contexts: tuple[int, ...] = DEFAULT_CONTEXTS, batch: int = 1,
                dtype: torch.dtype = torch.bfloat16) -> list[MemoryRow]:
    rows = []
    for n in contexts:
        hybrid = cache_bytes(cfg, n, batch, dtype)
        all_mla = cache_bytes(cfg, n, batch, dtype, layers=("mla",) * cfg.num_layers)["total"]
        all_mha = cache_bytes(cfg, n, batch, dtype, layers=("mha",) * cfg.num_layers)["total"]
        rows.append(MemoryRow(n, hybrid["kda"], hybrid["mla"], hybrid["total"], all_mla, all_mha))
    return rows


def memory_table(cfg: ModelConfig, contexts: tuple[int, ...] = DEFAULT_CONTEXTS, batch: int = 1,
                 dtype: torch.dtype = torch.bfloat16) -> Table:
    """A Rich table of `memory_rows` with ratios, titled with the config's parameter counts."""
    params = count_params(cfg)
    dtype_name = next((k for k, v in DTYPES.items() if v == dtype), str(dtype))
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False, title=(
        f"{cfg.name}: decode cache of {batch} sequence(s), {dtype_name}\n"
        f"{cfg.num_layers} layers = {cfg.count('kda')} KDA + {cfg.count('mla')} MLA, "
        f"{params['total'] / 1e9:,.1f}B params, {params['active'] / 1e9:,.1f}B active"),
        caption="KDA: fixed-size state (S in fp32); MLA: latent KV.\n"
                "all-MLA / all-MHA: every layer MLA / plain multi-head attention.")
    for col in ("context", "KDA", "MLA", "hybrid", "all-MLA", "all-MHA", "MLA/hyb", "MHA/hyb"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in memory_rows(cfg, contexts, batch, dtype):
        table.add_row(format_tokens(r.context), format_bytes(r.kda), format_bytes(r.mla), format_bytes(r.hybrid),
                      format_bytes(r.all_mla), format_bytes(r.all_mha),
                      f"{r.all_mla / r.hybrid:.2f}x", f"{r.all_mha / r.hybrid:.0f}x")
    return table
