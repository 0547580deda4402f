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
    (monotonic s), the MiB of creates placed on it still in flight (`placing`), and the sandboxes
    whose create (`placed`) or kill (`freed`) the stats do not count yet, with their MiB."""

    name: str
    handle: Any
    stats: NodeStats
    seen: float
    placing: int = 0
    placed: dict[str, int] = dataclasses.field(default_factory=dict)
    freed: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def view(self) -> NodeStats:
        """The stats with the gateway's own creates and kills they do not count yet counted in: as
        reserved (what placement ranks by) and as available (what it checks), so a burst of creates
        spreads without waiting for a heartbeat, and never counts one twice."""
        s = self.stats
        mb = self.placing + sum(self.placed.values()) - sum(self.freed.values())
        return dataclasses.replace(s, reserved_mb=max(0, s.reserved_mb + mb), available_mb=s.available_mb - mb)

    def absorb(self, stats: NodeStats) -> None:
        """New stats: the creates and kills they count are theirs now (a create they list, a kill
        they no longer list as holding memory)."""
        self.stats = stats
        self.placed = {sid: mb for sid, mb in self.placed.items() if sid not in stats.ids}
        self.freed = {sid: mb for sid, mb in self.freed.items() if sid in stats.holding}


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
        them back); `settle` once it is done."""
        with self._mu:
            if name in self._live:
                self._live[name].placing = max(0, self._live[name].placing + mb)

    def settle(self, name: str, sid: str, mb: int) -> None:
        """The create of sandbox `sid` (`mb` MiB) on node `name` is done: counted until stats list it."""
        with self._mu:
            if (m := self._live.get(name)) is not None:
                m.placing = max(0, m.placing - mb)
                if sid not in m.stats.ids:  # stats that arrived while its answer was on its way count it
                    m.placed[sid] = mb

    def release(self, name: str, sid: str, mb: int) -> None:
        """Sandbox `sid` on node `name` was killed while holding `mb` MiB: free until stats drop it."""
        with self._mu:
            if (m := self._live.get(name)) is not None and m.placed.pop(sid, None) is None \
                    and sid in m.stats.holding:
                m.freed[sid] = mb

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
                m.absorb(stats)
                m.seen = now
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
