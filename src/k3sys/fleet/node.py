"""A fleet node: a Ray actor pinned to one Ray node, owning that machine's sandbox `Runtime` (its own
runtime directory, so its own checkpoint store) and answering the gateway's calls.

    ray start --address HEAD:6379            # on the machine, then:
    k3sys fleet node --name n1 --home /var/lib/k3sys   # = start_node("n1", "/var/lib/k3sys")

The actor is named `k3sys-node-<name>` in the Ray namespace `k3sys` and detached, so it outlives the
command that started it and the gateway finds it by name. It is pinned with a hard node affinity (or
a custom resource) and never restarted elsewhere: a sandbox lives on one machine, and when that
machine goes the gateway reports its sandboxes lost instead of pretending they moved.

Calls the gateway routes (`ROUTED`) are plain `Runtime` methods run in the actor's threads
(`max_concurrency`): the runtime serialises operations per sandbox itself. A `SandboxError` comes back
as itself (`Fleet` unwraps Ray's wrapper). Checkpoints move by `pull`: this node asks the holder for
the manifest and then only the chunks its own store lacks (store/transfer.py), in bounded batches.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from k3sys.fleet.ports import PortRelay
from k3sys.sandbox.errors import CapacityError, InvalidArgumentError, NotFoundError
from k3sys.sandbox.runtime.runtime import Runtime
from k3sys.sandbox.runtime.store import Manifest
from k3sys.sandbox.runtime.store.transfer import Importer, batches, export_manifest, read_chunks
from k3sys.sandbox.spec import check_id

NAMESPACE = "k3sys"
PREFIX = "k3sys-node-"
# Runtime methods the gateway routes to a node, by what their first argument is.
BY_SANDBOX = frozenset({
    "info", "kill", "memory_bytes", "cpu_seconds", "run", "processes", "send_stdin", "signal_process",
    "resize_pty", "read_file", "write_file", "list_dir", "stat", "move", "remove", "make_dir", "exists", "pause",
    "resume", "checkpoint", "hibernate", "prefetch", "fork", "timings", "set_timeout"})
NEW_COMMAND = frozenset({"start_command", "start_process", "connect_command"})  # by sandbox id; return a command id
BY_COMMAND = frozenset({"wait_command", "command_output", "command_running", "kill_command", "command_pid",
                        "read_command_output", "command_exit", "release_command", "forget_command"})
OTHER = frozenset({"create", "list", "restore", "checkpoints", "get_checkpoint", "delete_checkpoint"})
ROUTED = BY_SANDBOX | NEW_COMMAND | BY_COMMAND | OTHER
PULL_BATCH = 32 << 20  # bytes of chunks per request while pulling a checkpoint: bounds both ends' memory
MAX_OPEN = 256  # files being streamed out and directories being watched at once through one node


@dataclasses.dataclass(frozen=True)
class NodeStats:
    """What a node reports: sizes in MiB, `cpus` cores, `reserved_cpus` the sum of its holding
    sandboxes' CPU limits, `sandboxes` counts by state, `load1` the host's 1-minute load average;
    `ids` every sandbox it has and `holding` those holding memory (so the gateway can tell which of
    its own creates and kills these stats already count)."""

    name: str
    host: str
    pid: int
    cpus: int
    reserved_cpus: float
    load1: float
    capacity_mb: int
    reserved_mb: int
    available_mb: int
    disk_free_mb: int
    sandboxes: dict[str, int]
    ids: frozenset[str] = frozenset()
    holding: frozenset[str] = frozenset()

    @property
    def free_mb(self) -> int:
        """Memory new sandboxes may still reserve here: the capacity less their limits (what placement
        ranks by: limits are what the cgroups enforce, while `available_mb` moves with everything else
        on the host)."""
        return max(0, self.capacity_mb - self.reserved_mb)

    def fits(self, memory_mb: int) -> bool:
        """Whether a sandbox of `memory_mb` MiB may go here: within the capacity, and the host has that
        much available now."""
        return self.free_mb >= memory_mb and self.available_mb >= memory_mb

    @property
    def free_cpus(self) -> float:
        return max(0.0, self.cpus - self.reserved_cpus)


def _meminfo_mb(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


class SandboxNode:
    """The actor's class (see the module docstring); `capacity_mb` defaults to the host's RAM."""

    def __init__(self, name: str, home: str, capacity_mb: int | None = None) -> None:
        self.name = check_id("node name", name)
        self.runtime = Runtime(Path(home), on_timeout="hibernate")
        self.capacity_mb = capacity_mb or _meminfo_mb("MemTotal")
        self._open: dict[int, Any] = {}  # handle -> a file being read or a directory watch (`close_open`)
        self._handles = itertools.count(1)
        self._mu = threading.Lock()
        self._relay: PortRelay | None = None  # made on the first port asked for

    def call(self, method: str, *args: Any) -> Any:
        """`Runtime.<method>(*args)`, for the methods in `ROUTED` only."""
        if method not in ROUTED:
            raise InvalidArgumentError(f"method: not routed to a node: {method!r}")
        return getattr(self.runtime, method)(*args)

    def open_port(self, sid: str, port: int) -> tuple[str, int, bytes]:
        """A connection to `port` inside sandbox `sid`, waiting at this node's relay (fleet/ports.py):
        (relay host, relay port, one-time ticket)."""
        with self._mu:
            if self._relay is None:
                self._relay = PortRelay(self.runtime, ray.util.get_node_ip_address())
        return self._relay.open(sid, port)

    def stats(self) -> NodeStats:
        infos = self.runtime.list()
        holding = [i for i in infos if i.state not in ("hibernated", "lost")]
        counts: dict[str, int] = {}
        for i in infos:
            counts[i.state] = counts.get(i.state, 0) + 1
        return NodeStats(self.name, socket.gethostname(), os.getpid(), os.cpu_count() or 1,
                         sum(i.spec.cpu for i in holding), os.getloadavg()[0], self.capacity_mb,
                         sum(i.spec.memory_mb for i in holding), _meminfo_mb("MemAvailable"),
                         shutil.disk_usage(self.runtime.root).free >> 20, counts,
                         frozenset(i.id for i in infos), frozenset(i.id for i in holding))

    def checkpoint_ids(self) -> list[str]:
        return [m.id for m in self.runtime.store.list()]

    def manifest(self, ck: str) -> Manifest:
        return self.runtime.store.get(ck)

    def store_stats(self) -> dict[str, int]:
        return self.runtime.store.stats()

    # --- streams through the gateway: output, file reads, directory watches -----------------------------

    def stream_command(self, cid: str) -> Iterator[tuple[str, str]]:
        """The command's output as it comes (a Ray streaming generator on the caller's side)."""
        yield from self.runtime.stream_command(cid)

    def new_command(self, method: str, sid: str, *args: Any) -> tuple[str, int]:
        """`Runtime.<method>` for a method of `NEW_COMMAND`: (the command id, its pid), in one call."""
        if method not in NEW_COMMAND:
            raise InvalidArgumentError(f"method: not one that starts a command: {method!r}")
        cid = self.call(method, sid, *args)
        return cid, self.runtime.command_pid(cid)

    def look(self, cid: str, since: tuple[int, int], wait_s: float) -> tuple[bytes, bytes, bool, Any]:
        """`Runtime.read_command_output`, waiting up to `wait_s` (at most 50 ms) for something new, plus
        how the command ended (`command_exit`) once it has: the gateway's output loop then needs one
        Ray call per look and none for the exit, and a short command ends within its first look."""
        deadline = time.monotonic() + min(max(wait_s, 0.0), 0.05)
        while True:
            out, err, done = self.runtime.read_command_output(cid, since)
            if out or err or done or time.monotonic() >= deadline:
                return out, err, done, self.runtime.command_exit(cid) if done else None
            time.sleep(0.001)

    def _hold(self, obj: Any) -> int:
        with self._mu:
            h = next(self._handles)
            self._open[h] = obj
            return h

    def _room(self) -> None:
        with self._mu:
            if len(self._open) >= MAX_OPEN:
                raise CapacityError(f"node {self.name} streams {MAX_OPEN} files and watches already; retry later")

    def _held(self, handle: int) -> Any:
        obj = self._open.get(handle)
        if obj is None:
            raise NotFoundError(f"no open file or watch {handle} on node {self.name}")
        return obj

    def open_file(self, sid: str, path: str, user: str | None = None) -> tuple[int, int]:
        """Open a file of sandbox `sid` for `read_open`; returns (handle, size in bytes)."""
        self._room()
        f = self.runtime.open_file(sid, path, user)
        return self._hold(f), f.size

    def read_open(self, handle: int, n: int) -> bytes:
        return self._held(handle).read(min(n, 8 << 20))

    def watch_dir(self, sid: str, path: str, recursive: bool = False, *more: Any) -> int:
        """Start watching a directory of sandbox `sid` (`Runtime.watch_dir`'s arguments); returns the
        handle for `watch_events`."""
        self._room()
        return self._hold(self.runtime.watch_dir(sid, path, recursive, *more))

    def watch_events(self, handle: int) -> list[Any]:
        return self._held(handle).get_new_events()

    def close_open(self, handle: int) -> None:
        with self._mu:
            obj = self._open.pop(handle, None)
        if obj is not None:
            (obj.close if hasattr(obj, "close") else obj.stop)()

    # --- checkpoints between nodes --------------------------------------------------------------------

    def export_manifest(self, ck: str) -> bytes:
        return export_manifest(self.runtime.store, ck)

    def read_chunks(self, ck: str, digests: list[bytes]) -> bytes:
        return read_chunks(self.runtime.store, ck, digests)

    def pull(self, ck: str, source: Any) -> tuple[int, float]:
        """Copy checkpoint `ck` from node actor `source` into this node's store, fetching only the
        chunks this store lacks; returns (bytes of chunks moved, seconds)."""
        t0 = time.perf_counter()
        imp = Importer(self.runtime.store, ray.get(source.export_manifest.remote(ck)))
        try:
            parts = list(batches(imp.needed, imp.lengths, PULL_BATCH))
            # One request ahead: the holder reads the next batch while this node checks and writes one.
            ahead = source.read_chunks.remote(ck, parts[0]) if parts else None
            for i, part in enumerate(parts):
                data = ray.get(ahead)
                ahead = source.read_chunks.remote(ck, parts[i + 1]) if i + 1 < len(parts) else None
                imp.add(part, data)
            imp.finish()
        finally:
            imp.abort()
        return imp.received, time.perf_counter() - t0

    def stop(self, kill_sandboxes: bool = False) -> None:
        """Let go of the runtime (killing its sandboxes if asked); `stop_node` then ends the actor."""
        if self._relay is not None:
            self._relay.close()
        if kill_sandboxes:
            self.runtime.kill_all()
        self.runtime.close()


NodeActor = ray.remote(SandboxNode)


def start_node(name: str, home: str | Path, *, node_id: str | None = None, resource: str | None = None,
               capacity_mb: int | None = None, max_concurrency: int = 64) -> Any:
    """Start node `name` (runtime directory `home`) as a detached actor pinned to Ray node `node_id`
    (default: the caller's) or to wherever custom `resource` is; returns its handle once it answers."""
    check_id("node name", name)
    opts: dict[str, Any] = dict(name=PREFIX + name, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                                max_concurrency=max_concurrency, max_restarts=0)
    if resource is not None:
        opts["resources"] = {resource: 1}
    else:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        target = node_id or ray.get_runtime_context().get_node_id()
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(target, soft=False)
    handle = NodeActor.options(**opts).remote(name, os.fspath(home), capacity_mb)
    ray.get(handle.stats.remote())  # up, or its constructor's error
    return handle


def stop_node(name: str, kill_sandboxes: bool = False, timeout_s: float = 120) -> None:
    """Stop node `name`: its runtime lets go of the directory (its sandboxes killed if asked, else left
    for the next node on that directory to adopt), then its actor ends."""
    handle = ray.get_actor(PREFIX + name, namespace=NAMESPACE)
    ray.get(handle.stop.remote(kill_sandboxes), timeout=timeout_s)
    ray.kill(handle)


def node_names() -> list[str]:
    """Names of the node actors alive in the cluster this process is connected to."""
    found = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"][len(PREFIX):] for a in found
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(PREFIX))
