"""Count the host syncs a piece of tensor code makes (what the device planner must never do).

A sync is anything that needs a tensor's values on the host: `.item()`, `int()`, `float()`, `bool()`
(all reach `aten._local_scalar_dense`), `.tolist()` (which bypasses the dispatcher, so it is wrapped
too), `torch.equal`, and every op whose output shape depends on the data (nonzero, unique, bincount,
masked_select, repeat_interleave with tensor repeats, indexing with a boolean mask), and `.cpu()`
(a copy to the host: free on a CPU tensor, a sync on a GPU one, so it is wrapped and counted too). The
count is made on any device, CPU included, so a CPU test proves the CUDA path sync-free.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_syncs"]

_SYNC_OPS = ("_local_scalar_dense", "equal", "nonzero", "_unique", "unique_", "unique_dim", "unique_consecutive",
             "bincount", "masked_select", "repeat_interleave.Tensor", "argwhere")


def _caller_module() -> str:
    """Module of the innermost k3sys frame on the stack outside this file ("" when none): the code
    that asked for the values (a native op's frames are not on the Python stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("k3sys.") and name != __name__:
            return name
        frame = frame.f_back
    return ""


class _SyncCounter(TorchDispatchMode):
    def __init__(self, counts: Counter, within: str | None) -> None:
        super().__init__()
        self.counts, self.within = counts, within

    def count(self, name: str) -> None:
        if self.within is None or (_caller_module() + ".").startswith(self.within + "."):
            self.counts[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (the dispatcher's protocol)
        name = str(func).removeprefix("aten.")
        bool_index = "index" in name and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args if isinstance(a, list | tuple) for i in a
        )
        if bool_index or any(name.startswith(op) for op in _SYNC_OPS):
            self.count(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def count_syncs(within: str | None = None) -> Iterator[Counter]:
    """`with count_syncs() as syncs: ...` -> `syncs` maps each syncing op to its calls (`sum(syncs.values())`).

    within: count only the syncs asked for by code in this package (e.g. "k3sys.ep"): the innermost
    k3sys frame on the Python stack is in it. Default: every sync.
    """
    counts: Counter = Counter()
    tolist, cpu = torch.Tensor.tolist, torch.Tensor.cpu
    counter = _SyncCounter(counts, within)

    def counted_tolist(self: torch.Tensor):  # noqa: ANN202 (list or scalar, as Tensor.tolist)
        counter.count("tolist")
        return tolist(self)

    def counted_cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        counter.count("cpu")
        return cpu(self, *args, **kwargs)

    torch.Tensor.tolist, torch.Tensor.cpu = counted_tolist, counted_cpu
    try:
        with counter:
            yield counts
    finally:
        torch.Tensor.tolist, torch.Tensor.cpu = tolist, cpu
