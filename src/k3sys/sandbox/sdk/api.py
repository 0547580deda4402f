"""The sandbox SDK: `Sandbox` with `.commands` and `.files`, and `Checkpoint`.

    with Sandbox.create(template="busybox", memory_mb=256) as sbx:
        r = sbx.commands.run("echo hi")            # CommandResult(stdout='hi\\n', stderr='', exit_code=0);
                                                   # a non-zero exit raises CommandExitError (E2B's rule)
        sbx.files.write("/tmp/x", b"data")
        ck = sbx.checkpoint()                      # Checkpoint(id=..., bytes_total=..., bytes_new=...)
        kids = sbx.fork(2)                         # two more running copies
        other = Sandbox.restore(ck)

Every call goes through a `Backend`: the embedded `Runtime` by default (one per process, on the
runtime directory `K3SYS_HOME` or ~/.local/share/k3sys), a sandbox service when `api_url=` (or
`K3SYS_API_URL`) is given (`k3sys.sandbox.sdk.client.HTTPBackend`, key from `api_key=` or `K3SYS_API_KEY`),
or any object with the same methods passed as `runtime=` (connection.py resolves these). The facade
itself holds nothing but the backend and an id, so every call reads the same whichever backend serves it.

The facade is written once for both SDKs: `AsyncSandbox` (aio.py) is `_Facade` over a backend whose
methods return awaitables. Each method hands the backend's answer to `_then`, which applies the
wrapping step at once here and after an `await` there (steps.py; `_chain` for a step that makes a
second call, `_gather` to join several); so in `AsyncSandbox` and `AsyncCheckpoint` every
method below returns an awaitable of what it returns here. The methods marked `by_id` are also
called on the class with a sandbox id first, as E2B's are: `Sandbox.kill(sandbox_id)` (by_id.py).
`.commands` and `.files` are E2B's (commands.py, files.py): there the asyncio side has typed
coroutine siblings, `AsyncCommands` and `AsyncFiles`, over the same call descriptions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Unpack

from k3sys.sandbox.egress import EgressPolicy
from k3sys.sandbox.errors import InvalidArgumentError
from k3sys.sandbox.sdk import steps
from k3sys.sandbox.sdk.backend import Backend
from k3sys.sandbox.sdk.by_id import by_id
from k3sys.sandbox.sdk.commands import CommandHandle, Commands
from k3sys.sandbox.sdk.connection import ConnectionConfig, ConnectionOpts, default_runtime
from k3sys.sandbox.sdk.files import Files, WriteInfo
from k3sys.sandbox.sdk.ports import host_for
from k3sys.sandbox.spec import SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo

__all__ = ["Backend", "Checkpoint", "CommandHandle", "Commands", "Files", "Sandbox", "SandboxList", "WriteInfo",
           "default_runtime"]


class _Blocking:
    """How the blocking facades reach their backend (aio.py's `_Awaiting` is the asyncio twin):
    `_then` applies a step to an answer, `_chain` a step that makes another call, `_gather` joins
    answers to a list."""

    _then = staticmethod(steps.now)
    _chain = staticmethod(steps.now)
    _gather = staticmethod(list)
    _found = staticmethod(steps.found_now)
    _connect = staticmethod(lambda conn: ConnectionConfig(**conn).backend())


@dataclass(frozen=True)
class _CheckpointBase:
    """What `Checkpoint` and `AsyncCheckpoint` share: the fields, `get`, `list`, `delete`."""

    _then: ClassVar[Callable[..., Any]]
    _connect: ClassVar[Callable[[ConnectionOpts], Any]]

    id: str
    parent: str | None
    created: float
    bytes_total: int
    bytes_new: int
    sandbox_id: str = ""
    template: str = ""
    timings: dict[str, float] = field(default_factory=dict, compare=False, repr=False)
    runtime: Any = field(default=None, compare=False, repr=False)

    @property
    def snapshot_id(self) -> str:
        """E2B's name of `id` (what `Sandbox.create(template=)` takes to restore it)."""
        return self.id

    @property
    def names(self) -> list[str]:
        """E2B's snapshot names: a checkpoint has only its id."""
        return [self.id]

    @classmethod
    def _of(cls, info: CheckpointInfo, runtime: Any) -> Any:
        return cls(info.id, info.parent, info.created, info.bytes_total, info.bytes_new, info.sandbox_id,
                   info.template, dict(info.timings), runtime)

    @classmethod
    def get(cls, id: str, **conn: Unpack[ConnectionOpts]) -> Any:
        rt = cls._connect(conn)
        return cls._then(rt.get_checkpoint(id), lambda info: cls._of(info, rt))

    @classmethod
    def list(cls, **conn: Unpack[ConnectionOpts]) -> Any:
        """Every stored checkpoint, oldest first."""
        rt = cls._connect(conn)
        return cls._then(rt.checkpoints(), lambda infos: [cls._of(i, rt) for i in infos])

    def delete(self) -> None:
        """Remove this checkpoint from the store (chunks other checkpoints share stay)."""
        return self._connect({"runtime": self.runtime}).delete_checkpoint(self.id)


@dataclass(frozen=True)
class Checkpoint(_Blocking, _CheckpointBase):
    """A stored snapshot of a sandbox: restore it any number of times with `Sandbox.restore`.

    `created` in unix seconds; `bytes_total` the checkpoint's logical size, `bytes_new` what it
    added to the store (the rest was already there); `timings` seconds per phase, when known."""


class _Facade:
    """What `Sandbox` and `AsyncSandbox` share: constructors, life cycle, `.commands`, `.files`."""

    _then: ClassVar[Callable[..., Any]]
    _chain: ClassVar[Callable[..., Any]]
    _gather: ClassVar[Callable[..., Any]]
    _found: ClassVar[Callable[..., Any]]
    _connect: ClassVar[Callable[[ConnectionOpts], Any]]
    _checkpoint: ClassVar[type[_CheckpointBase]]
    _handle: ClassVar[type[Any]]
    _commands: ClassVar[type[Any]]  # Commands or AsyncCommands
    _files: ClassVar[type[Any]]  # Files or AsyncFiles

    def __init__(self, runtime: Any, id: str, envs: dict[str, str] | None = None) -> None:
        self._rt = runtime
        self.id = id
        self._env = None if envs is None else dict(envs)
        self.commands = self._commands(self)
        self.files = self._files(self)

    @classmethod
    def _of(cls, rt: Any, info: SandboxInfo) -> Any:
        return cls(rt, info.id, info.spec.envs)

    @property
    def sandbox_id(self) -> str:
        """E2B's name of `id`."""
        return self.id

    def _envs(self) -> dict[str, str]:
        """The sandbox's own environment variables (`create(envs=)`), added to every command's."""
        return self._env or {}

    @classmethod
    def create(cls, template: str | None = None, timeout: float | None = None, metadata: dict[str, str] | None = None,
               envs: dict[str, str] | None = None, secure: bool | None = None,
               allow_internet_access: bool | None = None, *, network: bool | dict[str, Any] | None = None,
               cpu: float = 1.0, memory_mb: int = 512, pids: int = 256, timeout_s: float | None = None,
               on_timeout: str | None = None, disk_mb: int = 2048, id: str | None = None,
               egress: EgressPolicy | None = None, **conn: Unpack[ConnectionOpts]) -> Any:
        """Start a sandbox from `template` (None: "busybox"; a checkpoint id such as E2B's
        `create_snapshot().snapshot_id`: a restore of it). E2B's arguments: `timeout` its lifetime
        in s (None: until killed; k3sys's `timeout_s`), `metadata`, `envs` (every command's
        environment), `allow_internet_access` (k3sys's `network` bool; the default stays off), and
        `network` either that bool or E2B's `{"allow_out": [...], "deny_out": [...]}` (an egress
        policy). `secure` is accepted: every call is already authenticated. The rest are
        `SandboxSpec`'s; `id` is chosen by the caller (optional).

        `conn`: where (`runtime=`, or `api_url=`/`api_key=`; see `ConnectionConfig`).
        """
        if timeout is not None and timeout_s is not None:
            raise InvalidArgumentError("timeout: give either timeout= or its old name timeout_s=, not both")
        lifetime = (timeout or None) if timeout is not None else timeout_s
        if isinstance(network, dict):
            egress = EgressPolicy(allow_out=tuple(network.get("allow_out") or ()),
                                  deny_out=tuple(network.get("deny_out") or ()))
            network = True
        online = bool(network if network is not None else allow_internet_access or egress is not None)
        if template is not None and template.startswith("ck-"):
            return cls.restore(template, id=id, timeout_s=lifetime, **conn)
        rt = cls._connect(conn)
        spec = SandboxSpec(template or "busybox", cpu, memory_mb, pids, online, lifetime, on_timeout, disk_mb, egress,
                           metadata=dict(metadata or {}), envs=dict(envs or {}))
        return cls._then(rt.create(spec, id), lambda info: cls._of(rt, info))

    @by_id
    def connect(self, timeout: float | None = None) -> Any:
        """This sandbox running, resumed first when paused or hibernated (E2B's connect; also
        `Sandbox.connect(sandbox_id, timeout, **conn)`); `timeout` s: its new lifetime from now."""
        rt, cls = self._rt, type(self)

        def ready(info: SandboxInfo) -> Any:
            calls = [rt.resume(info.id)] if info.state in ("paused", "hibernated") else []
            calls += [rt.set_timeout(info.id, timeout)] if timeout else []
            return cls._then(cls._gather(calls), lambda _: cls._of(rt, info))
        return self._chain(rt.info(self.id), ready)

    @classmethod
    def restore(cls, checkpoint: _CheckpointBase | str, *, id: str | None = None, timeout_s: float | None = None,
                **conn: Unpack[ConnectionOpts]) -> Any:
        """A new running sandbox from a checkpoint (its processes, memory and files); on the
        checkpoint's own backend unless `conn` names one."""
        ck = checkpoint.id if isinstance(checkpoint, _CheckpointBase) else checkpoint
        if conn.get("runtime") is None and conn.get("api_url") is None and isinstance(checkpoint, _CheckpointBase):
            conn = {**conn, "runtime": checkpoint.runtime}
        rt = cls._connect(conn)
        return cls._then(rt.restore(ck, id, timeout_s), lambda info: cls._of(rt, info))

    @classmethod
    def get(cls, id: str, **conn: Unpack[ConnectionOpts]) -> Any:
        """The sandbox `id` in whatever state it is (`connect` also resumes it)."""
        rt = cls._connect(conn)
        return cls._then(rt.info(id), lambda info: cls._of(rt, info))

    @classmethod
    def list(cls, query: Any = None, limit: int | None = None, next_token: str | None = None,
             **conn: Unpack[ConnectionOpts]) -> Any:
        """Every sandbox of the runtime (including hibernated and lost ones), oldest first: a list of
        sandboxes that is also E2B's paginator (`has_next`, `next_items()`: their SandboxInfos).
        `query`: E2B's SandboxQuery (or an object with its fields): only sandboxes whose metadata
        holds `query.metadata`, in one of `query.state`, of `query.template`. All in one page:
        `limit` and `next_token` are accepted for E2B's signature."""
        rt = cls._connect(conn)
        meta = dict(getattr(query, "metadata", None) or {})
        states = {getattr(x, "value", x) for x in getattr(query, "state", None) or ()}
        template = getattr(query, "template", None)

        def page(infos: list[SandboxInfo]) -> SandboxList:
            infos = [i for i in infos if meta.items() <= i.spec.metadata.items() and (not states or i.state in states)
                     and template in (None, i.spec.template)]
            return SandboxList([cls._of(rt, i) for i in infos], infos)
        return cls._then(rt.list(), page)

    @by_id
    def get_info(self) -> Any:
        """The sandbox's SandboxInfo now (E2B's name; `info` is k3sys's earlier one)."""
        return self._rt.info(self.id)

    def get_host(self, port: int) -> str:
        """E2B's: the `host:port` that reaches `port` inside the sandbox (sdk/ports.py says which)."""
        return host_for(self._rt, self.id, port)

    def is_running(self, request_timeout: float | None = None) -> Any:
        return self._then(self._rt.info(self.id), lambda info: info.state == "running")

    @by_id
    def set_timeout(self, timeout: float) -> Any:
        """The sandbox's lifetime: `timeout` s from now."""
        return self._rt.set_timeout(self.id, timeout)

    def memory_bytes(self) -> int:
        """Memory charged to the sandbox's processes now, in bytes."""
        return self._rt.memory_bytes(self.id)

    def cpu_seconds(self) -> float:
        """CPU seconds charged to the sandbox's cgroup so far (restarts at 0 after a hibernation)."""
        return self._rt.cpu_seconds(self.id)

    @by_id
    def pause(self, keep_memory: bool | None = None, *, hibernate: bool = False) -> Any:
        """Freeze every process (no CPU; memory kept); True. Commands and files are refused until
        `resume` (or E2B's `connect`). `keep_memory` is E2B's and changes nothing (memory is always
        kept). `hibernate`: and hibernate it in the background: state "paused" (`then_hibernate`),
        then "hibernating", then "hibernated" (memory released, checkpoint durable); `resume` before
        that is a thaw, after it a restore."""
        return self._then(self._rt.pause(self.id, hibernate), lambda _: True)

    def resume(self) -> None:
        """Thaw a paused sandbox, or bring a hibernated one back (same id, same processes)."""
        return self._rt.resume(self.id)

    def checkpoint(self) -> Any:
        """Snapshot processes, memory and files into the store; the sandbox keeps running."""
        return self._then(self._rt.checkpoint(self.id), lambda info: self._checkpoint._of(info, self._rt))

    @by_id
    def create_snapshot(self, name: str | None = None) -> Any:
        """E2B's name of `checkpoint`: the Checkpoint's `snapshot_id` makes new sandboxes with
        `Sandbox.create(template=snapshot_id)`. `name` is accepted; checkpoints are named by id."""
        return self.checkpoint()

    @by_id
    def fork(self, n: int | None = None, *, count: int | None = None, timeout: float | None = None) -> Any:
        """`n` (E2B's `count`; default 1) new running sandboxes, each with this one's processes,
        memory and files as of now, each living `timeout` s (None: until killed). Nothing is added
        to the store (`checkpoint` first to keep this state). The count comes first, as k3sys had
        it: E2B's positional first argument is the timeout, so pass E2B's by name."""
        if n is not None and count is not None:
            raise InvalidArgumentError("count: give either fork(n) or fork(count=n), not both")
        rt, cls = self._rt, type(self)

        def kids(infos: list[SandboxInfo]) -> Any:
            made = [cls._of(rt, k) for k in infos]
            return cls._then(cls._gather([rt.set_timeout(k.id, timeout) for k in made] if timeout else []),
                             lambda _: made)
        return self._chain(rt.fork(self.id, n if n is not None else count or 1), kids)

    def hibernate(self) -> Any:
        """Checkpoint, then stop: memory and CPU released, state "hibernated"; `resume` restores it."""
        return self._then(self._rt.hibernate(self.id), lambda info: self._checkpoint._of(info, self._rt))

    def prefetch(self, ttl_s: float = 60.0) -> bool:
        """Hint that a hibernated sandbox will resume soon: its images are staged in memory now, so
        the `resume` skips reading the store. Returns whether they are staged (False unless
        hibernated); they are dropped after `ttl_s` seconds unless a resume used them."""
        return self._rt.prefetch(self.id, ttl_s)

    @by_id
    def kill(self) -> Any:
        """Stop the sandbox and release everything it held (its checkpoints stay in the store): True,
        or False if there was no such sandbox (E2B's answer)."""
        return self._found(lambda: self._rt.kill(self.id))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and other.id == self.id and other._rt is self._rt

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


class SandboxList(list):  # type: ignore[type-arg]
    """`Sandbox.list()`'s answer: the sandboxes, and E2B's paginator over their SandboxInfos (one
    page: `has_next` until `next_items()` has given it)."""

    def __init__(self, sandboxes: list[Any], infos: list[SandboxInfo]) -> None:
        super().__init__(sandboxes)
        self._infos = infos
        self.has_next = True

    def next_items(self) -> list[SandboxInfo]:
        self.has_next = False
        return list(self._infos)


class Sandbox(_Blocking, _Facade):
    """A handle on one sandbox. Construct with `create`, `restore`, `get`, `list` or `fork`."""

    _checkpoint = Checkpoint
    _handle = CommandHandle
    _commands = Commands
    _files = Files
    commands: Commands
    files: Files

    @property
    def info(self) -> SandboxInfo:
        """k3sys's earlier name of `get_info()`."""
        return self._rt.info(self.id)

    def _envs(self) -> dict[str, str]:
        if self._env is None:  # made from an id alone: ask once
            self._env = dict(self.get_info().spec.envs)
        return self._env

    @property
    def state(self) -> str:
        """"running", "paused", "hibernated", "lost", or a transitional state."""
        return self.info.state

    @property
    def spec(self) -> SandboxSpec:
        return self.info.spec

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
