"""The gateway's view of the nodes: which are alive, what each reports, and calling them.

A monitor thread looks every `heartbeat_s`: it finds node actors that joined (by their names in the
`k3sys` namespace) and asks every live node for its `NodeStats`. A node whose actor is dead (Ray says
so at once when its process dies) or that has not answered for `lost_after_s` is lost: `on_lost`
is told, and the node is never called again unless a node of that name answers anew (a restarted
actor on the same runtime directory, which adopts its sandboxes).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError

from k3sys.fleet.node import NAMESPACE, PREFIX, NodeStats, node_names
from k3sys.sandbox.errors import NotFoundError, SandboxError, UnavailableError


@dataclasses.dataclass(eq=False)
class Member:
    """A live node as the gateway sees it: its actor, its latest stats, when it last answered
    (monotonic s), the MiB placed on it by creates still in flight (`placing`), and the MiB its
    finished creates (+) and kills (-) changed since the stats were asked for (`charged`)."""

    name: str
    handle: Any
    stats: NodeStats
    seen: float
    charged: int = 0
    placing: int = 0

    @property
    def view(self) -> NodeStats:
        """The stats with what the gateway placed and killed since they were taken counted in: as
        reserved (what placement ranks by) and as available (what it checks), so a burst of creates
        spreads without waiting for a heartbeat."""
        s, mb = self.stats, self.charged + self.placing
        return dataclasses.replace(s, reserved_mb=max(0, s.reserved_mb + mb), available_mb=s.available_mb - mb)


class NodeDiedError(UnavailableError):
    """The node's actor is dead (its process or its machine): the node is lost."""


def unwrap(fn: Callable[[], Any], node: str) -> Any:
    """`fn()` (a `ray.get`), with a node's `SandboxError` raised as itself, a dead actor as
    `NodeDiedError` and one Ray cannot reach now as `UnavailableError`, each naming the node."""
    try:
        return fn()
    except RayTaskError as e:
        if isinstance(e.cause, SandboxError):
            raise e.cause from None
        raise
    except ActorDiedError as e:
        raise NodeDiedError(f"node {node} is gone: {str(e).splitlines()[0][:200]}") from None
    except RayActorError as e:  # ActorUnavailableError: maybe a moment's trouble; the heartbeat decides
        raise UnavailableError(f"node {node} cannot be reached: {str(e).splitlines()[0][:200]}") from None


class Members:
    """Live nodes and the monitor thread (see the module docstring)."""

    def __init__(self, heartbeat_s: float, lost_after_s: float, on_join: Callable[[Member], None],
                 on_lost: Callable[[str, str], None]) -> None:
        self.heartbeat_s, self.lost_after_s = heartbeat_s, lost_after_s
        self._on_join, self._on_lost = on_join, on_lost
        self._mu = threading.Lock()
        self._live: dict[str, Member] = {}
        self.lost: dict[str, str] = {}  # node name -> why it was lost
        self._stop = threading.Event()
        self.tick()
        self._thread = threading.Thread(target=self._run, name="k3sys-fleet-monitor", daemon=True)
        self._thread.start()

    def live(self) -> list[Member]:
        with self._mu:
            return list(self._live.values())

    def get(self, name: str) -> Member:
        with self._mu:
            m = self._live.get(name)
        if m is None:
            why = self.lost.get(name)
            raise UnavailableError(f"node {name} is lost: {why}" if why else f"no node {name!r} in the fleet")
        return m

    def charge(self, name: str, mb: int) -> None:
        """Count `mb` MiB placed on node `name` by a create in flight (negative: a failed one gives
        them back); `settle` once it is done. No stats hold it yet, so none absorbs it."""
        with self._mu:
            if name in self._live:
                self._live[name].placing = max(0, self._live[name].placing + mb)

    def settle(self, name: str, placed_mb: int = 0, freed_mb: int = 0) -> None:
        """A create of `placed_mb` MiB on node `name` is done (its charge moves from in flight to
        done), or a kill freed `freed_mb`: counted until stats asked for after it arrive (`tick`),
        never dropped by stats asked for before it, which may have missed it."""
        with self._mu:
            if (m := self._live.get(name)) is not None:
                m.placing = max(0, m.placing - placed_mb)
                m.charged += placed_mb - freed_mb

    def call(self, name: str, method: str, *args: Any) -> Any:
        """`Runtime.<method>(*args)` on node `name`; a dead node is marked lost at once."""
        return self.invoke(name, "call", method, *args)

    def invoke(self, name: str, actor_method: str, *args: Any) -> Any:
        """The node actor's own `actor_method(*args)` on node `name` (lost at once if dead)."""
        m = self.get(name)
        try:
            return unwrap(lambda: ray.get(getattr(m.handle, actor_method).remote(*args)), name)
        except NodeDiedError as e:
            self.lose(name, str(e))
            raise

    def tick(self) -> None:
        """One look: join new nodes, refresh the live ones' stats, lose the silent or dead ones."""
        with self._mu:
            known = set(self._live)
        for name in set(node_names()) - known:
            self._join(name)
        now = time.monotonic()
        live = self.live()
        with self._mu:  # charges made before the request are in its answer; later ones stay
            sent = {m.name: m.charged for m in live}
        refs = {m.handle.stats.remote(): m for m in live}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.heartbeat_s) if refs else ([], [])
        answered = set()
        for ref in ready:
            m = refs[ref]
            try:
                stats = unwrap(lambda ref=ref: ray.get(ref), m.name)
            except NodeDiedError as e:
                self.lose(m.name, str(e))
                continue
            except (UnavailableError, RayTaskError):
                continue  # not an answer: lost once silent for `lost_after_s`
            answered.add(m.name)
            with self._mu:
                m.stats, m.seen = stats, now
                m.charged -= sent[m.name]  # what was done before the request is in its answer
        for m in live:
            if m.name not in answered and now - m.seen > self.lost_after_s:
                self.lose(m.name, f"no answer for {now - m.seen:.1f} s")

    def _join(self, name: str) -> None:
        try:
            handle = ray.get_actor(PREFIX + name, namespace=NAMESPACE)
            stats = unwrap(lambda: ray.get(handle.stats.remote(), timeout=self.lost_after_s), name)
        except (ValueError, GetTimeoutError, UnavailableError, NotFoundError):
            return  # gone again, or not answering: not a member
        m = Member(name, handle, stats, time.monotonic())
        self._on_join(m)  # tables first: a call routed to it must find its sandboxes
        with self._mu:
            self._live[name] = m
            self.lost.pop(name, None)

    def lose(self, name: str, why: str) -> None:
        with self._mu:
            if self._live.pop(name, None) is None:
                return
            self.lost[name] = why
        self._on_lost(name, why)

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a failed look (the cluster busy) is retried next tick
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
