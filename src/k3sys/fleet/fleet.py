"""`Fleet`: the `Runtime`'s methods over many nodes, so the sandbox service (and the SDK, and the
rollout engine) use a fleet exactly as they use one runtime:

    fleet = Fleet(address="auto")                    # connects to Ray, finds the node actors
    app = create_app(ServiceConfig(...), runtime=fleet)   # the gateway: `k3sys fleet gateway`
    Sandbox.create(runtime=fleet)                    # or embedded, in a Ray driver

Placement (placement.py) picks a node for each new sandbox unless the caller names one; every later
call is routed by sandbox id (the gateway's table, filled from the nodes as they join) or by command
id (the gateway's command ids carry their node: `<node's id>~<node>`). Calls are Ray actor calls
(~1.3 ms here, see docs/fleet.md for why not a second HTTP hop); command output streams as a Ray
streaming generator, a file read or a directory watch as a handle the node keeps open.

`Fleet` routes and delegates; the work is done by parts built with what they use, each owning its
state:

    Fleet ─┬─> Moves      moves.py      copies of checkpoints, hibernate, resume, migrate, restore, fork
           ├─> Commands   commands.py   gateway command ids, pids and exits kept, followed output
           ├─> Sandboxes  sandboxes.py  create, info, list, kill, pause, checkpoint(s)
           └─> Members    members.py    live nodes, their stats, calls to them (a monitor thread)
    Moves ──> Sandboxes ──> Placer (placement.py) ──> Members
                   └──────> Records (records.py): where each sandbox is, who holds each checkpoint
    Commands ──> Members, Records.node_of;  Members ──(a node joins / is lost)──> Records

A node that dies takes its running sandboxes with it: they stay listed, state "lost" with the
reason, until killed. Its hibernated sandboxes whose checkpoint another node holds (every
hibernation is replicated to a second node, `FleetConfig.replicate_hibernated`) stay "hibernated"
and resume elsewhere, same id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, BinaryIO

import ray

from k3sys.fleet.commands import LOOK_WAIT_S, Commands, PolledFollower
from k3sys.fleet.config import FleetConfig
from k3sys.fleet.members import Member, Members, unwrap
from k3sys.fleet.moves import Moves, Transfer
from k3sys.fleet.node import BY_COMMAND, BY_SANDBOX, NAMESPACE, NEW_COMMAND
from k3sys.fleet.placement import Placer
from k3sys.fleet.records import Records
from k3sys.fleet.sandboxes import Sandboxes
from k3sys.sandbox.runtime.store import Manifest
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo


class RemoteHandle:
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

    def __enter__(self) -> RemoteHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FleetStore:
    """What the service reads of `Runtime.store`: a checkpoint's manifest, the sizes summed over nodes."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self._sandboxes = sandboxes

    def get(self, ck: str) -> Manifest:
        return self._sandboxes.manifest(ck)

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in ray.get([m.handle.store_stats.remote() for m in self._sandboxes.members.live()]):
            for k, v in s.items():
                out[k] = out.get(k, 0) + v
        return out


class Fleet:
    """Sandboxes of every node of a Ray cluster; see the module docstring."""

    def __init__(self, address: str | None = None, config: FleetConfig | None = None) -> None:
        """`address`: the Ray cluster ("auto", "HOST:PORT"; ignored if this process is connected already)."""
        if not ray.is_initialized():
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        self.config = config or FleetConfig()
        self.records = Records()
        self.members = Members(self.config.heartbeat_s, self.config.lost_after_s, self._joined, self.records.lost)
        self.placer = Placer(self.members, self.config.policy)
        self.sandboxes = Sandboxes(self.config, self.members, self.records, self.placer)
        self.commands = Commands(self.members, self.records.node_of)
        self.moves = Moves(self.config, self.members, self.sandboxes)
        self.transfers: deque[Transfer] = self.moves.transfers
        self.store = FleetStore(self.sandboxes)

    def _joined(self, m: Member) -> None:
        infos = unwrap(lambda: ray.get(m.handle.call.remote("list")), m.name)
        cks = unwrap(lambda: ray.get(m.handle.checkpoint_ids.remote()), m.name)
        self.records.joined(m.name, infos, cks)

    def node_of(self, sid: str) -> str:
        """The node sandbox `sid` lives on; InvalidStateError if that node is lost."""
        return self.records.node_of(sid)

    def holder(self, ck: str, prefer: str | None = None) -> str:
        """A live node whose store holds checkpoint `ck` (`prefer` if it does)."""
        return self.sandboxes.holder(ck, prefer)

    def nodes(self) -> dict[str, Any]:
        """Each live node's latest `NodeStats`, and each lost node's reason."""
        return {**{m.name: m.view for m in self.members.live()}, **self.members.lost}

    def place(self, memory_mb: int, node: str | None = None, exclude: tuple[str, ...] = ()) -> str:
        """The node a new sandbox goes to (`node` if named), counted in its view until its stats list it."""
        return self.placer.place(memory_mb, node, exclude)

    # --- routing ------------------------------------------------------------------------------------

    def __getattr__(self, method: str) -> Any:
        """The `Runtime` methods that only need routing: by sandbox id or by command id."""
        if method in BY_SANDBOX:
            return lambda sid, *args: self.members.call(self.node_of(sid), method, sid, *args)
        if method in NEW_COMMAND:
            return lambda sid, *args: self.commands.new_command(method, sid, *args)
        if method in BY_COMMAND:
            def by_command(cid: str, *args: Any) -> Any:
                own, node = self.commands.split(cid)
                return self.members.call(node, method, own, *args)
            return by_command
        raise AttributeError(method)

    def run(self, sid: str, cmd: str, timeout: float | None = 60, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: bytes | None = None) -> CommandResult:
        return self.members.call(self.node_of(sid), "run", sid, cmd, timeout, cwd, env, stdin)

    def stream_command(self, cid: str) -> Iterator[tuple[str, str]]:
        own, node = self.commands.split(cid)
        m = self.members.get(node)
        for ref in m.handle.stream_command.options(num_returns="streaming").remote(own):
            yield unwrap(lambda ref=ref: ray.get(ref), node)

    def open_port(self, sid: str, port: int) -> tuple[str, int, bytes]:
        """Port `port` inside sandbox `sid`, connected by its node and waiting at the node's relay:
        (host, port, one-time ticket) for the gateway's port proxy (fleet/ports.py)."""
        return self.members.invoke(self.node_of(sid), "open_port", sid, port)

    def open_file(self, sid: str, path: str, user: str | None = None) -> RemoteHandle:
        node = self.node_of(sid)
        m = self.members.get(node)
        h, size = unwrap(lambda: ray.get(m.handle.open_file.remote(sid, path, user)), node)
        return RemoteHandle(m.handle, node, h, size=size)

    def write_file(self, sid: str, path: str, data: bytes | str | BinaryIO, user: str | None = None,
                   xattrs: dict[str, bytes] | None = None) -> int:
        # A stream (the service's spool, bounded by its body limit) goes to the node as bytes.
        body = data.read() if hasattr(data, "read") else data
        return self.members.call(self.node_of(sid), "write_file", sid, path, body, user, xattrs)

    def watch_dir(self, sid: str, path: str, recursive: bool = False, *more: Any) -> RemoteHandle:
        node = self.node_of(sid)
        m = self.members.get(node)
        h = unwrap(lambda: ray.get(m.handle.watch_dir.remote(sid, path, recursive, *more)), node)
        return RemoteHandle(m.handle, node, h, path=path, recursive=recursive)

    # --- commands (commands.py) ---------------------------------------------------------------------

    def command_pid(self, cid: str) -> int:
        return self.commands.command_pid(cid)

    def read_command_output(self, cid: str, since: tuple[int, int] = (0, 0),
                            wait_s: float = LOOK_WAIT_S) -> tuple[bytes, bytes, bool]:
        return self.commands.read_command_output(cid, since, wait_s)

    def command_exit(self, cid: str) -> Any:
        return self.commands.command_exit(cid)

    def release_command(self, cid: str) -> None:
        self.commands.release_command(cid)

    def forget_command(self, cid: str) -> None:
        self.commands.forget_command(cid)

    def start_followed(self, sid: str, cmd: str | list[str], cwd: str | None = None,
                       env: dict[str, str] | None = None, user: str | None = None,
                       stdin: bool | bytes | None = None, pty: tuple[int, int] | None = None
                       ) -> tuple[str, PolledFollower]:
        """`Runtime.start_followed` across nodes: the command started on its node, its output looked at."""
        return self.commands.start_followed(sid, cmd, cwd, env, user, stdin, pty)

    def follow_command(self, cid: str, pos: int = 0) -> PolledFollower:
        """`Runtime.follow_command` across nodes, from the command's first byte."""
        return self.commands.follow_command(cid, pos)

    # --- sandboxes (sandboxes.py) -------------------------------------------------------------------

    def create(self, spec: SandboxSpec, id: str | None = None, node: str | None = None) -> SandboxInfo:
        """A new sandbox on the node placement picks (or `node`)."""
        return self.sandboxes.create(spec, id, node)

    def info(self, sid: str) -> SandboxInfo:
        return self.sandboxes.info(sid)

    def list(self) -> list[SandboxInfo]:
        """Every sandbox of every live node, and those of lost nodes (state "lost" or "hibernated")."""
        return self.sandboxes.list()

    def kill(self, sid: str) -> None:
        """Kill the sandbox; one on a lost node is only forgotten (its machine took it)."""
        self.sandboxes.kill(sid)

    def pause(self, sid: str, hibernate: bool = False) -> None:
        """Freeze the sandbox; `hibernate` (E2B's pause): hibernate it, synchronously here: the fleet
        must know the checkpoint to record where it is held and to replicate it."""
        if hibernate:
            self.moves.hibernate(sid)
        else:
            self.sandboxes.pause(sid)

    def checkpoint(self, sid: str) -> CheckpointInfo:
        return self.sandboxes.checkpoint(sid)

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint of every live node (one entry per id, wherever it is held)."""
        return self.sandboxes.checkpoints()

    def get_checkpoint(self, ck: str) -> CheckpointInfo:
        return self.sandboxes.get_checkpoint(ck)

    def delete_checkpoint(self, ck: str) -> None:
        """Delete `ck` from every live node holding it (refused while a hibernated sandbox needs it)."""
        self.sandboxes.delete_checkpoint(ck)

    # --- moves between nodes (moves.py) -------------------------------------------------------------

    def copy_checkpoint(self, ck: str, node: str) -> Transfer:
        """Make node `node`'s store hold checkpoint `ck`, pulling only the chunks it lacks from a holder."""
        return self.moves.copy_checkpoint(ck, node)

    def replicate(self, ck: str, node: str | None = None) -> Transfer:
        """Copy checkpoint `ck` to `node`, or to a node not holding it yet (placement picks)."""
        return self.moves.replicate(ck, node)

    def hibernate(self, sid: str) -> CheckpointInfo:
        return self.moves.hibernate(sid)

    def resume(self, sid: str) -> None:
        """Thaw or restore the sandbox, on another node (same id) when its own has no room or is lost."""
        self.moves.resume(sid)

    def migrate(self, sid: str, node: str | None = None) -> SandboxInfo:
        """Move the sandbox to `node` (placement picks one other than its own if None)."""
        return self.moves.migrate(sid, node)

    def restore(self, ck: str, id: str | None = None, timeout_s: float | None = None,
                node: str | None = None) -> SandboxInfo:
        """A new sandbox from checkpoint `ck` on `node` or the node placement picks (which pulls `ck`)."""
        return self.moves.restore(ck, id, timeout_s, node)

    def fork(self, sid: str, n: int = 1, nodes: list[str] | None = None) -> list[SandboxInfo]:
        """`n` copies of the sandbox now; `nodes` names each child's node (moves.py)."""
        return self.moves.fork(sid, n, nodes)

    def close(self) -> None:
        """Stop watching the nodes; they and their sandboxes carry on."""
        self.members.close()
