"""Where a new sandbox goes: the placement policies over the nodes' free memory (`NodeStats.free_mb`:
capacity less the memory limits of the sandboxes there; a node fits only if the host also has the
memory available now).

    spread   the node with the most free memory (ties: fewer sandboxes, then name): load evens out,
             a lost node takes the fewest sandboxes with it
    pack     the node with the least free memory that still fits (ties: name): whole nodes stay free
             for large sandboxes, or to be given back to the cluster
"""

from __future__ import annotations

from collections.abc import Iterable

from k3sys.fleet.node import NodeStats
from k3sys.sandbox.errors import CapacityError, InvalidArgumentError

POLICIES = ("spread", "pack")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise InvalidArgumentError(f"policy: expected one of {POLICIES}, got {policy!r}")
    return policy


def choose(nodes: Iterable[NodeStats], memory_mb: int, policy: str, exclude: Iterable[str] = ()) -> str:
    """The name of the node a sandbox of `memory_mb` MiB goes to under `policy` (never one in `exclude`)."""
    check_policy(policy)
    skip = set(exclude)
    candidates = [s for s in nodes if s.name not in skip]
    fits = [s for s in candidates if s.fits(memory_mb)]
    if not fits:
        best = max((s.free_mb for s in candidates), default=0)
        raise CapacityError(f"no node has {memory_mb} MiB free for a sandbox ({len(candidates)} nodes "
                            f"considered, the most free: {best} MiB)")
    if policy == "spread":
        return min(fits, key=lambda s: (-s.free_mb, sum(s.sandboxes.values()), s.name)).name
    return min(fits, key=lambda s: (s.free_mb, s.name)).name
