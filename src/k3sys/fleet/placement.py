"""Where a new sandbox goes: the placement policies over the nodes' free memory (`NodeStats.free_mb`:
capacity less the memory limits of the sandboxes there; a node fits only if the host also has the
memory available now).

    spread   the node with the most free memory (ties: fewer sandboxes, then name): load evens out,
             a lost node takes the fewest sandboxes with it
    pack     the node with the least free memory that still fits (ties: name): whole nodes stay free
             for large sandboxes, or to be given back to the cluster

`Placer` chooses and charges as one step, so concurrent creates see each other's placements.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from k3sys.fleet.members import Members
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


class Placer:
    """Picks the node of each new sandbox among `members`' live nodes under `policy`."""

    def __init__(self, members: Members, policy: str) -> None:
        self.members, self.policy = members, check_policy(policy)
        self._mu = threading.Lock()

    def place(self, memory_mb: int, node: str | None = None, exclude: tuple[str, ...] = ()) -> str:
        """The node a new sandbox goes to (`node` if named), counted in its view until its stats list
        the sandbox (`Members.settle`; a failed create gives the charge back with `Members.charge`)."""
        with self._mu:  # choose and charge as one step: concurrent creates see each other
            name = node if node is not None else choose([m.view for m in self.members.live()], memory_mb,
                                                        self.policy, exclude)
            self.members.get(name)
            self.members.charge(name, memory_mb)
        return name

    def free(self, exclude: tuple[str, ...] = ()) -> str:
        """A node with room, not in `exclude` (for a copy of a checkpoint: nothing is charged)."""
        return choose([m.view for m in self.members.live()], 0, self.policy, exclude)
