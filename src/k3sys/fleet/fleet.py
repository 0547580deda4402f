"""`Fleet`: the `Runtime`'s methods over many nodes, so the sandbox service (and the SDK, and the
rollout engine) use a fleet exactly as they use one runtime:

    fleet = Fleet(address="auto")                    # connects to Ray, finds the node actors
    app = create_app(ServiceConfig(...), runtime=fleet)   # the gateway: `k3sys fleet gateway`
    Sandbox.create(runtime=fleet)                    # or embedded, in a Ray driver

Placement (placement.py) picks a node for each new sandbox unless the caller names one; every later
call is routed by sandbox id (the gateway's table, filled from the nodes as they join) or by command
id (the gateway's command ids carry their node: `<node's id>~<node>`). Calls are Ray actor calls
(~1.3 ms here, see docs/fleet.md for why not a second HTTP hop); command output streams as a Ray
streaming generator, a file read or a directory watch as a handle the node keeps open. Moves between nodes (checkpoints,
migration, forks over nodes, resume after a node loss) are in moves.py.

A node that dies takes its running sandboxes with it: they stay listed, state "lost" with the
reason, until killed. Its hibernated sandboxes whose checkpoint another node holds (every
hibernation is replicated to a second node, `FleetConfig.replicate_hibernated`) stay "hibernated"
and resume elsewhere, same id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, BinaryIO

import ray

from k3sys.fleet.commands import Commands
from k3sys.fleet.config import FleetConfig
from k3sys.fleet.members import Member, Members, NodeDiedError, unwrap
from k3sys.fleet.moves import Moves, Transfer
from k3sys.fleet.node import BY_COMMAND, BY_SANDBOX, NAMESPACE, NEW_COMMAND
from k3sys.fleet.placement import choose
from k3sys.sandbox.errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandboxError,
)
from k3sys.sandbox.runtime.store import Manifest
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo


class _Remote:
    """Something a node holds open for the gateway, by handle: a file being read (`Runtime.open_file`'s
    `size`, `read`, `close`) or a directory watch (`WatchHandle`'s `path`, `get_new_events`, `stop`)."""

    def __init__(self, handle: Any, node: str, h: int, **attrs: Any) -> None:
        self._handle, self._node, self._h = handle, node, h
        self.__dict__.update(attrs)

    def read(self, n: int) -> bytes:
        return unwrap(lambda: ray.get(self._handle.read_open.remote(self._h, n)), self._node)

    def get_new_events(self) -> list[Any]:
        return unwrap(lambda: ray.get(self._handle.watch_events.remote(self._h)), self._node)

    def close(self) -> None:
        self._handle.close_open.remote(self._h)

    stop = close

    def __enter__(self) -> _Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _FleetStore:
    """What the service reads of `Runtime.store`: a checkpoint's manifest, the sizes summed over nodes."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def get(self, ck: str) -> Manifest:
        m = self._fleet.members.get(self._fleet.holder(ck))
        return unwrap(lambda: ray.get(m.handle.manifest.remote(ck)), m.name)

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in ray.get([m.handle.store_stats.remote() for m in self._fleet.members.live()]):
            for k, v in s.items():
                out[k] = out.get(k, 0) + v
        return out


class Fleet(Commands, Moves):
    """Sandboxes of every node of a Ray cluster; see the module docstring."""

    def __init__(self, address: str | None = None, config: FleetConfig | None = None) -> None:
        """`address`: the Ray cluster ("auto", "HOST:PORT"; ignored if this process is connected already)."""
        if not ray.is_initialized():
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        self.config = config or FleetConfig()
        self._mu = threading.RLock()
        self._where: dict[str, str | None] = {}  # sandbox id -> node (None: on a lost node)
        self._last: dict[str, SandboxInfo] = {}  # sandbox id -> latest info seen
        self._fresh: dict[str, float] = {}  # sandbox id -> when (monotonic s) its info was last seen
        self._claimed: set[str] = set()  # ids of creates in flight
        self._placing = threading.Lock()
        self._holders: dict[str, set[str]] = {}  # checkpoint id -> live nodes whose store has it
        self.transfers: deque[Transfer] = deque(maxlen=1000)
        self.store = _FleetStore(self)
        self._commands_init()
        self.members = Members(self.config.heartbeat_s, self.config.lost_after_s, self._joined, self._lost)

    # --- tables ------------------------------------------------------------------------------------

    def _joined(self, m: Member) -> None:
        infos = unwrap(lambda: ray.get(m.handle.call.remote("list")), m.name)
        cks = unwrap(lambda: ray.get(m.handle.checkpoint_ids.remote()), m.name)
        with self._mu:
            for i in infos:
                self._note(m.name, i)
            for ck in cks:
                self._holders.setdefault(ck, set()).add(m.name)

    def _lost(self, name: str, why: str) -> None:
        with self._mu:
            for holders in self._holders.values():
                holders.discard(name)
            for sid, node in list(self._where.items()):
                if node != name:
                    continue
                self._where[sid] = None
                last = self._last[sid]
                if last.state == "hibernated" and self._holders.get(last.head or ""):
                    continue  # resumable from another node's copy
                self._last[sid] = dataclasses.replace(last, state="lost", reason=f"node {name} lost: {why}")

    def _placed(self, node: str, info: SandboxInfo) -> SandboxInfo:
        """`_note` a sandbox a placement put on `node`, its create done (`Members.settle`)."""
        self.members.settle(node, info.id, info.spec.memory_mb)
        return self._note(node, info)

    def _note(self, node: str, info: SandboxInfo) -> SandboxInfo:
        with self._mu:
            self._where[info.id] = node
            self._last[info.id] = info
            self._fresh[info.id] = time.monotonic()
        return info

    def _seen(self, sid: str, **changes: Any) -> None:
        """Record a change the fleet made to sandbox `sid` (its state, head) without asking its node."""
        with self._mu:
            if sid in self._last:
                self._last[sid] = dataclasses.replace(self._last[sid], **changes)
                self._fresh[sid] = time.monotonic()

    def _forget(self, sid: str) -> None:
        with self._mu:
            self._where.pop(sid, None)
            self._last.pop(sid, None)
            self._fresh.pop(sid, None)

    def node_of(self, sid: str) -> str:
        """The node sandbox `sid` lives on; InvalidStateError if that node is lost."""
        with self._mu:
            if sid in self._where:
                node = self._where[sid]
                if node is not None:
                    return node
                last = self._last[sid]
                raise InvalidStateError(f"sandbox {sid} is {last.state} ({last.reason or 'its node is lost'})")
        raise NotFoundError(f"no sandbox {sid!r}")

    def holder(self, ck: str, prefer: str | None = None) -> str:
        """A live node whose store holds checkpoint `ck` (`prefer` if it does)."""
        with self._mu:
            holders = sorted(self._holders.get(ck, ()))
        if not holders:
            self.checkpoints()  # a checkpoint made behind the gateway's back
            with self._mu:
                holders = sorted(self._holders.get(ck, ()))
        if not holders:
            raise CheckpointNotFoundError(f"no checkpoint {ck!r} on any live node")
        return prefer if prefer in holders else holders[0]

    def _held(self, ck: str, node: str) -> None:
        with self._mu:
            self._holders.setdefault(ck, set()).add(node)

    def nodes(self) -> dict[str, Any]:
        """Each live node's latest `NodeStats`, and each lost node's reason."""
        return {**{m.name: m.view for m in self.members.live()}, **self.members.lost}

    def place(self, memory_mb: int, node: str | None = None, exclude: tuple[str, ...] = ()) -> str:
        """The node a new sandbox goes to (`node` if named), counted in its view until its stats list the sandbox."""
        with self._placing:  # choose and charge as one step: concurrent creates see each other
            name = node if node is not None else choose([m.view for m in self.members.live()], memory_mb,
                                                        self.config.policy, exclude)
            self.members.get(name)
            self.members.charge(name, memory_mb)
        return name

    # --- routing ------------------------------------------------------------------------------------

    def __getattr__(self, method: str) -> Any:
        """The `Runtime` methods that only need routing: by sandbox id or by command id."""
        if method in BY_SANDBOX:
            return lambda sid, *args: self.members.call(self.node_of(sid), method, sid, *args)
        if method in NEW_COMMAND:
            return lambda sid, *args: self._new_command(method, sid, *args)
        if method in BY_COMMAND:
            def by_command(cid: str, *args: Any) -> Any:
                own, node = self._split(cid)
                return self.members.call(node, method, own, *args)
            return by_command
        raise AttributeError(method)

    def run(self, sid: str, cmd: str, timeout: float | None = 60, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: bytes | None = None) -> CommandResult:
        return self.members.call(self.node_of(sid), "run", sid, cmd, timeout, cwd, env, stdin)

    def stream_command(self, cid: str) -> Iterator[tuple[str, str]]:
        own, node = self._split(cid)
        m = self.members.get(node)
        for ref in m.handle.stream_command.options(num_returns="streaming").remote(own):
            yield unwrap(lambda ref=ref: ray.get(ref), node)

    def open_file(self, sid: str, path: str, user: str | None = None) -> _Remote:
        node = self.node_of(sid)
        m = self.members.get(node)
        h, size = unwrap(lambda: ray.get(m.handle.open_file.remote(sid, path, user)), node)
        return _Remote(m.handle, node, h, size=size)

    def write_file(self, sid: str, path: str, data: bytes | str | BinaryIO, user: str | None = None,
                   xattrs: dict[str, bytes] | None = None) -> int:
        # A stream (the service's spool, bounded by its body limit) goes to the node as bytes.
        body = data.read() if hasattr(data, "read") else data
        return self.members.call(self.node_of(sid), "write_file", sid, path, body, user, xattrs)

    def watch_dir(self, sid: str, path: str, recursive: bool = False, *more: Any) -> _Remote:
        node = self.node_of(sid)
        m = self.members.get(node)
        h = unwrap(lambda: ray.get(m.handle.watch_dir.remote(sid, path, recursive, *more)), node)
        return _Remote(m.handle, node, h, path=path, recursive=recursive)

    # --- sandboxes ----------------------------------------------------------------------------------

    def create(self, spec: SandboxSpec, id: str | None = None, node: str | None = None) -> SandboxInfo:
        """A new sandbox on the node placement picks (or `node`)."""
        with self._claim(id):
            name = self.place(spec.memory_mb, node)
            try:
                return self._placed(name, self.members.call(name, "create", spec, id))
            except BaseException:
                self.members.charge(name, -spec.memory_mb)
                raise

    @contextlib.contextmanager
    def _claim(self, sid: str | None) -> Iterator[None]:
        """Hold id `sid` for a create in flight: ids are unique over the whole fleet."""
        if sid is not None:
            with self._mu:
                if sid in self._where or sid in self._claimed:
                    raise InvalidArgumentError(f"id: sandbox {sid!r} already exists")
                self._claimed.add(sid)
        try:
            yield
        finally:
            with self._mu:
                self._claimed.discard(sid or "")

    def info(self, sid: str) -> SandboxInfo:
        with self._mu:
            node, last, seen = self._where.get(sid, ""), self._last.get(sid), self._fresh.get(sid, -1e18)
        if node is None and last is not None:
            return last  # on a lost node: what we knew, marked lost (or hibernated, resumable elsewhere)
        if last is not None and time.monotonic() - seen < self.config.info_ttl_s:
            return last
        if not node:
            raise NotFoundError(f"no sandbox {sid!r}")
        try:
            return self._note(node, self.members.call(node, "info", sid))
        except NodeDiedError:
            return self._last[sid]  # marked lost (or resumable elsewhere) by now
        except NotFoundError:
            self._forget(sid)  # killed on its node behind our back (its timeout)
            raise

    def _gather(self, method: str) -> dict[str, Any]:
        """`Runtime.<method>()`'s answer from every live node that gives one, by node name."""
        refs = {m.name: m.handle.call.remote(method) for m in self.members.live()}
        out = {}
        for name, ref in refs.items():
            with contextlib.suppress(SandboxError):  # a node failing now: the monitor decides whether it is lost
                out[name] = unwrap(lambda ref=ref: ray.get(ref), name)
        return out

    def list(self) -> list[SandboxInfo]:
        """Every sandbox of every live node, and those of lost nodes (state "lost" or "hibernated")."""
        seen: dict[str, SandboxInfo] = {}
        for name, infos in self._gather("list").items():
            for i in infos:
                seen[i.id] = self._note(name, i)
        with self._mu:
            # Not forgotten when missing from their node's answer: a create may have finished after
            # the node answered. A sandbox gone behind our back is forgotten by `info`.
            seen |= {sid: self._last[sid] for sid, node in self._where.items() if node is None}
        return sorted(seen.values(), key=lambda i: (i.created, i.id))

    def kill(self, sid: str) -> None:
        """Kill the sandbox; one on a lost node is only forgotten (its machine took it)."""
        with self._mu:
            known, node, last = sid in self._where, self._where.get(sid), self._last.get(sid)
        if not known:
            raise NotFoundError(f"no sandbox {sid!r}")
        if node is not None:
            self.members.call(node, "kill", sid)
            if last is not None and last.state not in ("hibernated", "lost"):  # its memory is free at once
                self.members.release(node, sid, last.spec.memory_mb)
        self._forget(sid)

    def pause(self, sid: str, hibernate: bool = False) -> None:
        """Freeze the sandbox; `hibernate` (E2B's pause): hibernate it, synchronously here: the fleet
        must know the checkpoint to record where it is held and to replicate it."""
        if hibernate:
            self.hibernate(sid)
            return
        self.members.call(self.node_of(sid), "pause", sid)
        self._seen(sid, state="paused")

    def checkpoint(self, sid: str) -> CheckpointInfo:
        node = self.node_of(sid)
        ck = self.members.call(node, "checkpoint", sid)
        self._held(ck.id, node)
        return ck

    # --- checkpoints --------------------------------------------------------------------------------

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint of every live node (one entry per id, wherever it is held)."""
        out: dict[str, CheckpointInfo] = {}
        for name, infos in self._gather("checkpoints").items():
            for c in infos:
                out.setdefault(c.id, c)
                self._held(c.id, name)
        return sorted(out.values(), key=lambda c: (c.created, c.id))

    def get_checkpoint(self, ck: str) -> CheckpointInfo:
        return self.members.call(self.holder(ck), "get_checkpoint", ck)

    def delete_checkpoint(self, ck: str) -> None:
        """Delete `ck` from every live node holding it (refused, as on one node, while a hibernated
        sandbox needs it)."""
        self.holder(ck)  # NotFoundError unless a live node holds it
        with self._mu:
            nodes = sorted(self._holders.get(ck, ()))
        for node in nodes:
            self.members.call(node, "delete_checkpoint", ck)
            with self._mu:
                self._holders.get(ck, set()).discard(node)

    def close(self) -> None:
        """Stop watching the nodes; they and their sandboxes carry on."""
        self.members.close()
