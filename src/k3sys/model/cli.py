"""`k3sys memory`: the decode-cache calculator for a model preset."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from k3sys.model.config import PRESETS, ModelConfig

# The calculator needs torch dtypes; it is imported when the command runs, so the CLI starts without torch.
CACHE_DTYPES = ("bf16", "fp16", "fp32", "fp8")


def memory(
    preset: Annotated[str, typer.Option(help=f"Model preset: {', '.join(sorted(PRESETS))}.")] = "k3",
    context: Annotated[str, typer.Option(help="Context length to add to 4K / 128K / 1M (binary K, M).")] = "1M",
    batch: Annotated[int, typer.Option(min=1, help="Sequences held at once.")] = 1,
    dtype: Annotated[str, typer.Option(help=f"Cache dtype: {', '.join(CACHE_DTYPES)}.")] = "bf16",
) -> None:
    """Decode-cache bytes by layer kind (KDA state vs MLA latent KV) beside all-MLA and all-MHA models."""
    from k3sys.model.memory import DEFAULT_CONTEXTS, DTYPES, memory_table, parse_tokens

    try:
        cfg = ModelConfig.from_preset(preset)
        n = parse_tokens(context)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    contexts = tuple(sorted({*DEFAULT_CONTEXTS, n}))
    Console().print(memory_table(cfg, contexts, batch, DTYPES[dtype]))
