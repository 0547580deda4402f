"""A pool of real gloo ranks started once and reused by many checks (process start-up dominates here).

`RankPool(4)` spawns 4 processes in one gloo group on 127.0.0.1 (1 thread each) plus the subgroups
{0, 1} and {0, 1, 2}; `pool.run(fn, *args, ranks=2)` runs `fn(group, *args)` on the first `ranks` ranks and
returns their results in rank order. `fn` must be a module-level function (it is pickled by name).
A check that does not finish within `timeout` seconds fails the test and the pool is torn down, so a
hang in a collective never hangs CI; gloo's own timeout also turns a stuck collective into an error.
"""

from __future__ import annotations

import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 30


class RankError(RuntimeError):
    """A check raised on some rank; the message holds every failing rank's traceback."""


def _worker(rank: int, world: int, init_method: str, inbox: Any, outbox: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    groups = {world: dist.group.WORLD}
    for size in range(2, world):
        groups[size] = dist.new_group(list(range(size)))  # every rank takes part in creating a subgroup
    outbox.put((rank, "ready", None))
    while (job := inbox.get()) is not None:
        fn, size, args = job
        try:
            outbox.put((rank, "ok", fn(groups[size], *args)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
            outbox.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankPool:
    """`world` gloo ranks in worker processes, reusable across checks."""

    def __init__(self, world: int, timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = f"tcp://127.0.0.1:{port}"
        self.world, self.timeout = world, timeout
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._procs = [ctx.Process(target=_worker, args=(r, world, init, self._inboxes[r], self._outbox), daemon=True)
                       for r in range(world)]
        for p in self._procs:
            p.start()
        self._collect(range(world), timeout)

    def run(self, fn: Callable[..., Any], *args: Any, ranks: int | None = None, timeout: float | None = None) -> list:
        """Run `fn(group, *args)` on ranks `0 .. ranks-1` (default all); results in rank order."""
        size = ranks or self.world
        if not 2 <= size <= self.world:
            raise ValueError(f"ranks must be in [2, {self.world}], got {size}")
        for r in range(size):
            self._inboxes[r].put((fn, size, args))
        return self._collect(range(size), timeout or self.timeout)

    def _collect(self, ranks: range, timeout: float) -> list:
        results: dict[int, tuple[str, Any]] = {}
        try:
            while len(results) < len(ranks):
                rank, status, value = self._outbox.get(timeout=timeout)
                results[rank] = (status, value)
        except queue.Empty:
            self.close()
            errors = "".join(f"\nrank {r}: {v}" for r, (st, v) in sorted(results.items()) if st == "error")
            raise TimeoutError(f"ranks {sorted(set(ranks) - set(results))} did not finish within {timeout} s"
                               + errors) from None
        errors = [f"rank {r}: {v}" for r, (st, v) in sorted(results.items()) if st == "error"]
        if errors:
            raise RankError("\n".join(errors))
        return [results[r][1] for r in ranks]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for box, p in zip(self._inboxes, self._procs, strict=True):
            if p.is_alive():
                box.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
