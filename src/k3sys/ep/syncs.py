"""Count the host syncs a piece of tensor code makes (what the device planner must never do).

A sync is anything that needs a tensor's values on the host: `.item()`, `int()`, `float()`, `bool()`
(all reach `aten._local_scalar_dense`), `.tolist()` (which bypasses the dispatcher, so it is wrapped
too), `torch.equal`, and every op whose output shape depends on the data (nonzero, unique, bincount,
masked_select, repeat_interleave with tensor repeats, indexing with a boolean mask). The count is made
on any device, CPU included, so a CPU test proves the CUDA path sync-free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_syncs"]

_SYNC_OPS = ("_local_scalar_dense", "equal", "nonzero", "_unique", "unique_", "unique_dim", "unique_consecutive",
             "bincount", "masked_select", "repeat_interleave.Tensor", "argwhere")


class _SyncCounter(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (the dispatcher's protocol)
        name = str(func).removeprefix("aten.")
        bool_index = "index" in name and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args if isinstance(a, list | tuple) for i in a
        )
        if bool_index or any(name.startswith(op) for op in _SYNC_OPS):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_syncs() -> Iterator[Counter]:
    """`with count_syncs() as syncs: ...` -> `syncs` maps each syncing op to its calls (`sum(syncs.values())`)."""
    counts: Counter = Counter()
    tolist = torch.Tensor.tolist

    def counted_tolist(self: torch.Tensor):  # noqa: ANN202 (list or scalar, as Tensor.tolist)
        counts["tolist"] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with _SyncCounter(counts):
            yield counts
    finally:
        torch.Tensor.tolist = tolist
