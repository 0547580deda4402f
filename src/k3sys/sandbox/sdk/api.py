"""The sandbox SDK: `Sandbox` with `.commands` and `.files`, and `Checkpoint`.

    with Sandbox.create(template="busybox", memory_mb=256) as sbx:
        r = sbx.commands.run("echo hi")            # CommandResult(stdout='hi\\n', stderr='', exit_code=0)
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
wrapping step at once here (`_now`) and after an `await` there (`_later`); so in `AsyncSandbox`,
`AsyncCheckpoint` and `AsyncCommandHandle` every method below returns an awaitable of what it
returns here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, ClassVar, TypeVar, Unpack

from k3sys.sandbox.egress import EgressPolicy
from k3sys.sandbox.errors import NotFoundError
from k3sys.sandbox.sdk.backend import Backend
from k3sys.sandbox.sdk.connection import ConnectionConfig, ConnectionOpts, default_runtime
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, EntryInfo, ProcessInfo, SandboxInfo

T = TypeVar("T")
R = TypeVar("R")
__all__ = ["Backend", "Checkpoint", "CommandHandle", "Commands", "Files", "Sandbox", "default_runtime"]


def _now(value: T, then: Callable[[T], R]) -> R:
    """The blocking facades' step: the backend has answered already."""
    return then(value)


async def _later(value: Awaitable[T], then: Callable[[T], R]) -> R:
    """The asyncio facades' step: the backend gave an awaitable."""
    return then(await value)


class _Blocking:
    """How the blocking facades reach their backend (aio.py's `_Awaiting` is the asyncio twin)."""

    _then = staticmethod(_now)
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
    added to the store (the rest was already there); `timings` seconds per phase, when known.
    """


class _CommandHandleBase:
    def __init__(self, runtime: Any, cid: str) -> None:
        self._rt = runtime
        self.id = cid

    def wait(self, timeout: float | None = None) -> CommandResult:
        """Block until the command ends (CommandTimeoutError, and the command killed, after `timeout` s)."""
        return self._rt.wait_command(self.id, timeout)

    def kill(self) -> None:
        """SIGKILL the command and what it started."""
        return self._rt.kill_command(self.id)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) written so far."""
        return self._rt.command_output(self.id)

    @property
    def pid(self) -> Any:
        """The command's pid inside the sandbox (what `commands.connect` takes in a fork or restore)."""
        return self._rt.command_pid(self.id)

    def stream(self) -> Iterator[tuple[str, str]]:
        """`("stdout" | "stderr", text)` pieces as the command writes them, from its start until it
        ends; `wait` gives the exit code afterwards."""
        return self._rt.stream_command(self.id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


class CommandHandle(_CommandHandleBase):
    """A command started with `background=True`."""

    @property
    def running(self) -> bool:
        return self._rt.command_running(self.id)


class Commands:
    """`sbx.commands`: run shell commands in the sandbox."""

    def __init__(self, sandbox: _Facade) -> None:
        self._sbx = sandbox

    def run(self, cmd: str, timeout: float | None = 60, cwd: str | None = None, env: dict[str, str] | None = None,
            background: bool = False, stdin: bytes | str | None = None) -> Any:
        """Run `sh -c cmd`. Returns a CommandResult, or a CommandHandle with `background=True`.

        `timeout` in seconds (None: no limit; ignored with `background`, see `CommandHandle.wait`);
        on timeout the command is killed and CommandTimeoutError raised. A non-zero exit is not an
        error: check `exit_code` (128+N when a signal N ended it).
        """
        data = stdin.encode() if isinstance(stdin, str) else stdin
        sbx = self._sbx
        rt = sbx._rt
        if background:
            return sbx._then(rt.start_command(sbx.id, cmd, cwd, env, data), lambda cid: sbx._handle(rt, cid))
        return rt.run(sbx.id, cmd, timeout, cwd, env, data)

    def list(self) -> list[ProcessInfo]:
        """The processes the sandbox's agent started and still holds (running, or ended and not yet
        collected), by pid."""
        return self._sbx._rt.processes(self._sbx.id)

    def connect(self, pid: int) -> Any:
        """A CommandHandle on process `pid` (from `list` or a handle's `pid`): a background command
        seen again in a fork or a restored sandbox, with its earlier and new output."""
        sbx = self._sbx
        return sbx._then(sbx._rt.connect_command(sbx.id, pid), lambda cid: sbx._handle(sbx._rt, cid))


class Files:
    """`sbx.files`: the sandbox's file system. Paths are the sandbox's own; none can leave its root."""

    def __init__(self, sandbox: _Facade) -> None:
        self._sbx = sandbox

    def read(self, path: str) -> bytes:
        return self._sbx._rt.read_file(self._sbx.id, path)

    def read_text(self, path: str) -> str:
        return self._sbx._then(self.read(path), bytes.decode)

    def write(self, path: str, data: bytes | str | BinaryIO) -> int:
        """Create or replace a file (missing parent directories are created); returns bytes written.
        `data` may be a binary file object: it is streamed, never held in memory whole."""
        return self._sbx._rt.write_file(self._sbx.id, path, data)

    def list(self, path: str = "/") -> list[EntryInfo]:
        return self._sbx._rt.list_dir(self._sbx.id, path)

    def remove(self, path: str) -> None:
        """Remove a file, symlink or directory tree."""
        return self._sbx._rt.remove(self._sbx.id, path)

    def make_dir(self, path: str) -> None:
        return self._sbx._rt.make_dir(self._sbx.id, path)

    def exists(self, path: str) -> bool:
        return self._sbx._rt.exists(self._sbx.id, path)

    def watch_dir(self, path: str, recursive: bool = False) -> Any:
        """Watch a directory (with `recursive`, its whole tree) for changes, as E2B's SDK does: the
        handle's `get_new_events()` gives the `FilesystemEvent`s since the last call, `stop()` ends
        it. Over HTTP the service keeps the watch (envd's CreateWatcher) and `get_new_events()` asks
        it; `dropped` and `overflows` are embedded only."""
        return self._sbx._rt.watch_dir(self._sbx.id, path, recursive)


class _Facade:
    """What `Sandbox` and `AsyncSandbox` share: constructors, life cycle, `.commands`, `.files`."""

    _then: ClassVar[Callable[..., Any]]
    _connect: ClassVar[Callable[[ConnectionOpts], Any]]
    _checkpoint: ClassVar[type[_CheckpointBase]]
    _handle: ClassVar[type[_CommandHandleBase]]

    def __init__(self, runtime: Any, id: str) -> None:
        self._rt = runtime
        self.id = id
        self.commands = Commands(self)
        self.files = Files(self)

    @classmethod
    def create(cls, template: str = "busybox", cpu: float = 1.0, memory_mb: int = 512, pids: int = 256,
               network: bool = False, timeout_s: float | None = None, on_timeout: str | None = None,
               disk_mb: int = 2048, *, id: str | None = None, egress: EgressPolicy | None = None,
               **conn: Unpack[ConnectionOpts]) -> Any:
        """Start a sandbox (see `SandboxSpec` for the arguments; `id` optional, chosen by the caller).

        `conn`: where (`runtime=`, or `api_url=`/`api_key=`; see `ConnectionConfig`).
        """
        rt = cls._connect(conn)
        spec = SandboxSpec(template, cpu, memory_mb, pids, network, timeout_s, on_timeout, disk_mb, egress)
        return cls._then(rt.create(spec, id), lambda info: cls(rt, info.id))

    @classmethod
    def restore(cls, checkpoint: _CheckpointBase | str, *, id: str | None = None, timeout_s: float | None = None,
                **conn: Unpack[ConnectionOpts]) -> Any:
        """A new running sandbox from a checkpoint (its processes, memory and files); on the
        checkpoint's own backend unless `conn` names one."""
        ck = checkpoint.id if isinstance(checkpoint, _CheckpointBase) else checkpoint
        if conn.get("runtime") is None and conn.get("api_url") is None and isinstance(checkpoint, _CheckpointBase):
            conn = {**conn, "runtime": checkpoint.runtime}
        rt = cls._connect(conn)
        return cls._then(rt.restore(ck, id, timeout_s), lambda info: cls(rt, info.id))

    @classmethod
    def get(cls, id: str, **conn: Unpack[ConnectionOpts]) -> Any:
        rt = cls._connect(conn)
        return cls._then(rt.info(id), lambda info: cls(rt, info.id))

    @classmethod
    def list(cls, **conn: Unpack[ConnectionOpts]) -> Any:
        """Every sandbox of the runtime (including hibernated and lost ones), oldest first."""
        rt = cls._connect(conn)
        return cls._then(rt.list(), lambda infos: [cls(rt, i.id) for i in infos])

    def memory_bytes(self) -> int:
        """Memory charged to the sandbox's processes now, in bytes."""
        return self._rt.memory_bytes(self.id)

    def cpu_seconds(self) -> float:
        """CPU seconds charged to the sandbox's cgroup so far (restarts at 0 after a hibernation)."""
        return self._rt.cpu_seconds(self.id)

    def pause(self, hibernate: bool = False) -> None:
        """Freeze every process (no CPU; memory kept). Commands and files are refused until `resume`.
        `hibernate`: and hibernate it in the background (E2B's pause): state "paused" (`info.then_hibernate`),
        then "hibernating", then "hibernated" (memory released, checkpoint durable); `resume` before
        that is a thaw, after it a restore."""
        return self._rt.pause(self.id, hibernate)

    def resume(self) -> None:
        """Thaw a paused sandbox, or bring a hibernated one back (same id, same processes)."""
        return self._rt.resume(self.id)

    def checkpoint(self) -> Any:
        """Snapshot processes, memory and files into the store; the sandbox keeps running."""
        return self._then(self._rt.checkpoint(self.id), lambda info: self._checkpoint._of(info, self._rt))

    def fork(self, n: int = 1) -> Any:
        """`n` new running sandboxes, each with this one's processes, memory and files as of now.
        Nothing is added to the store (`checkpoint` first to keep this state)."""
        return self._then(self._rt.fork(self.id, n), lambda kids: [type(self)(self._rt, k.id) for k in kids])

    def hibernate(self) -> Any:
        """Checkpoint, then stop: memory and CPU released, state "hibernated"; `resume` restores it."""
        return self._then(self._rt.hibernate(self.id), lambda info: self._checkpoint._of(info, self._rt))

    def prefetch(self, ttl_s: float = 60.0) -> bool:
        """Hint that a hibernated sandbox will resume soon: its images are staged in memory now, so
        the `resume` skips reading the store. Returns whether they are staged (False unless
        hibernated); they are dropped after `ttl_s` seconds unless a resume used them."""
        return self._rt.prefetch(self.id, ttl_s)

    def kill(self) -> None:
        """Stop the sandbox and release everything it held (its checkpoints stay in the store)."""
        return self._rt.kill(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and other.id == self.id and other._rt is self._rt

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


class Sandbox(_Blocking, _Facade):
    """A handle on one sandbox. Construct with `create`, `restore`, `get`, `list` or `fork`."""

    _checkpoint = Checkpoint
    _handle = CommandHandle

    @property
    def info(self) -> SandboxInfo:
        return self._rt.info(self.id)

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
        with contextlib.suppress(NotFoundError):
            self.kill()
