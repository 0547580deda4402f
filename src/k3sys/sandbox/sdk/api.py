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
or any object with the same methods passed as `runtime=`. The facade itself holds nothing but the
backend and an id, so every call reads the same whichever backend serves it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

from k3sys.sandbox.errors import NotFoundError
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, EntryInfo, SandboxInfo


class Backend(Protocol):
    """What the facade needs from a runtime, embedded or remote (see `Runtime` for each method)."""

    def create(self, spec: SandboxSpec, id: str | None = None) -> SandboxInfo: ...
    def info(self, sid: str) -> SandboxInfo: ...
    def list(self) -> list[SandboxInfo]: ...
    def kill(self, sid: str) -> None: ...
    def memory_bytes(self, sid: str) -> int: ...
    def cpu_seconds(self, sid: str) -> float: ...
    def start_command(self, sid: str, cmd: str, cwd: str | None = None, env: dict[str, str] | None = None,
                      stdin: bytes | None = None) -> str: ...
    def wait_command(self, cid: str, timeout: float | None = None) -> CommandResult: ...
    def command_output(self, cid: str) -> tuple[str, str]: ...
    def stream_command(self, cid: str) -> Iterator[tuple[str, str]]: ...
    def command_running(self, cid: str) -> bool: ...
    def kill_command(self, cid: str) -> None: ...
    def run(self, sid: str, cmd: str, timeout: float | None = 60, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: bytes | None = None) -> CommandResult: ...
    def read_file(self, sid: str, path: str) -> bytes: ...
    def write_file(self, sid: str, path: str, data: bytes | str | BinaryIO) -> int: ...
    def list_dir(self, sid: str, path: str = "/") -> list[EntryInfo]: ...
    def remove(self, sid: str, path: str) -> None: ...
    def make_dir(self, sid: str, path: str) -> None: ...
    def exists(self, sid: str, path: str) -> bool: ...
    def pause(self, sid: str) -> None: ...
    def resume(self, sid: str) -> None: ...
    def checkpoint(self, sid: str) -> CheckpointInfo: ...
    def hibernate(self, sid: str) -> CheckpointInfo: ...
    def prefetch(self, sid: str, ttl_s: float = 60.0) -> bool: ...
    def fork(self, sid: str, n: int = 1) -> tuple[CheckpointInfo, list[SandboxInfo]]: ...
    def restore(self, ck: str, id: str | None = None, timeout_s: float | None = None) -> SandboxInfo: ...
    def checkpoints(self) -> list[CheckpointInfo]: ...
    def get_checkpoint(self, ck: str) -> CheckpointInfo: ...
    def delete_checkpoint(self, ck: str) -> None: ...


_default: Backend | None = None
_default_lock = threading.Lock()


def default_runtime() -> Backend:
    """The process-wide backend: a client of the service at `K3SYS_API_URL` when that is set, else
    the embedded runtime, opened on first use."""
    global _default
    if os.environ.get("K3SYS_API_URL"):
        return _backend(api_url=os.environ["K3SYS_API_URL"])
    with _default_lock:
        if _default is None:
            from k3sys.sandbox.runtime.runtime import Runtime  # the runtime (and its store) only when embedded

            _default = Runtime()
        return _default


def _backend(runtime: Backend | None = None, api_url: str | None = None, api_key: str | None = None) -> Backend:
    if runtime is not None:
        return runtime
    if api_url is not None:
        from k3sys.sandbox.sdk.client import connect  # httpx only for remote use

        return connect(api_url, api_key)
    return default_runtime()


@dataclass(frozen=True)
class Checkpoint:
    """A stored snapshot of a sandbox: restore it any number of times with `Sandbox.restore`.

    `created` in unix seconds; `bytes_total` the checkpoint's logical size, `bytes_new` what it
    added to the store (the rest was already there); `timings` seconds per phase, when known.
    """

    id: str
    parent: str | None
    created: float
    bytes_total: int
    bytes_new: int
    sandbox_id: str = ""
    template: str = ""
    timings: dict[str, float] = field(default_factory=dict, compare=False, repr=False)
    runtime: Backend | None = field(default=None, compare=False, repr=False)

    @classmethod
    def _of(cls, info: CheckpointInfo, runtime: Backend) -> Checkpoint:
        return cls(info.id, info.parent, info.created, info.bytes_total, info.bytes_new, info.sandbox_id,
                   info.template, dict(info.timings), runtime)

    @classmethod
    def get(cls, id: str, runtime: Backend | None = None, *, api_url: str | None = None,
            api_key: str | None = None) -> Checkpoint:
        rt = _backend(runtime, api_url, api_key)
        return cls._of(rt.get_checkpoint(id), rt)

    @classmethod
    def list(cls, runtime: Backend | None = None, *, api_url: str | None = None,
             api_key: str | None = None) -> list[Checkpoint]:
        """Every stored checkpoint, oldest first."""
        rt = _backend(runtime, api_url, api_key)
        return [cls._of(i, rt) for i in rt.checkpoints()]

    def delete(self) -> None:
        """Remove this checkpoint from the store (chunks other checkpoints share stay)."""
        _backend(self.runtime).delete_checkpoint(self.id)


class CommandHandle:
    """A command started with `background=True`."""

    def __init__(self, runtime: Backend, cid: str) -> None:
        self._rt = runtime
        self.id = cid

    def wait(self, timeout: float | None = None) -> CommandResult:
        """Block until the command ends (CommandTimeoutError, and the command killed, after `timeout` s)."""
        return self._rt.wait_command(self.id, timeout)

    def kill(self) -> None:
        """SIGKILL the command and what it started."""
        self._rt.kill_command(self.id)

    @property
    def running(self) -> bool:
        return self._rt.command_running(self.id)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) written so far."""
        return self._rt.command_output(self.id)

    def stream(self) -> Iterator[tuple[str, str]]:
        """`("stdout" | "stderr", text)` pieces as the command writes them, from its start until it
        ends; `wait` gives the exit code afterwards."""
        return self._rt.stream_command(self.id)

    def __repr__(self) -> str:
        return f"CommandHandle({self.id!r})"


class Commands:
    """`sbx.commands`: run shell commands in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def run(self, cmd: str, timeout: float | None = 60, cwd: str | None = None, env: dict[str, str] | None = None,
            background: bool = False, stdin: bytes | str | None = None) -> Any:
        """Run `sh -c cmd`. Returns a CommandResult, or a CommandHandle with `background=True`.

        `timeout` in seconds (None: no limit; ignored with `background`, see `CommandHandle.wait`);
        on timeout the command is killed and CommandTimeoutError raised. A non-zero exit is not an
        error: check `exit_code` (128+N when a signal N ended it).
        """
        data = stdin.encode() if isinstance(stdin, str) else stdin
        rt, sid = self._sbx._rt, self._sbx.id
        if background:
            return CommandHandle(rt, rt.start_command(sid, cmd, cwd, env, data))
        return rt.run(sid, cmd, timeout, cwd, env, data)


class Files:
    """`sbx.files`: the sandbox's file system. Paths are the sandbox's own; none can leave its root."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def read(self, path: str) -> bytes:
        return self._sbx._rt.read_file(self._sbx.id, path)

    def read_text(self, path: str) -> str:
        return self.read(path).decode()

    def write(self, path: str, data: bytes | str | BinaryIO) -> int:
        """Create or replace a file (missing parent directories are created); returns bytes written.
        `data` may be a binary file object: it is streamed, never held in memory whole."""
        return self._sbx._rt.write_file(self._sbx.id, path, data)

    def list(self, path: str = "/") -> list[EntryInfo]:
        return self._sbx._rt.list_dir(self._sbx.id, path)

    def remove(self, path: str) -> None:
        """Remove a file, symlink or directory tree."""
        self._sbx._rt.remove(self._sbx.id, path)

    def make_dir(self, path: str) -> None:
        self._sbx._rt.make_dir(self._sbx.id, path)

    def exists(self, path: str) -> bool:
        return self._sbx._rt.exists(self._sbx.id, path)


class Sandbox:
    """A handle on one sandbox. Construct with `create`, `restore`, `get`, `list` or `fork`."""

    def __init__(self, runtime: Backend, id: str) -> None:
        self._rt = runtime
        self.id = id
        self.commands = Commands(self)
        self.files = Files(self)

    @classmethod
    def create(cls, template: str = "busybox", cpu: float = 1.0, memory_mb: int = 512, pids: int = 256,
               network: bool = False, timeout_s: float | None = None, on_timeout: str | None = None, *,
               id: str | None = None, runtime: Backend | None = None, api_url: str | None = None,
               api_key: str | None = None) -> Sandbox:
        """Start a sandbox (see `SandboxSpec` for the arguments; `id` optional, chosen by the caller).

        `api_url`/`api_key`: a sandbox service to create it on (default `K3SYS_API_URL`, else embedded).
        """
        rt = _backend(runtime, api_url, api_key)
        spec = SandboxSpec(template, cpu, memory_mb, pids, network, timeout_s, on_timeout)
        return cls(rt, rt.create(spec, id).id)

    @classmethod
    def restore(cls, checkpoint: Checkpoint | str, *, id: str | None = None, timeout_s: float | None = None,
                runtime: Backend | None = None, api_url: str | None = None, api_key: str | None = None) -> Sandbox:
        """A new running sandbox from a checkpoint (its processes, memory and files)."""
        ck = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
        if runtime is None and api_url is None and isinstance(checkpoint, Checkpoint):
            runtime = checkpoint.runtime
        rt = _backend(runtime, api_url, api_key)
        return cls(rt, rt.restore(ck, id, timeout_s).id)

    @classmethod
    def get(cls, id: str, runtime: Backend | None = None, *, api_url: str | None = None,
            api_key: str | None = None) -> Sandbox:
        rt = _backend(runtime, api_url, api_key)
        return cls(rt, rt.info(id).id)

    @classmethod
    def list(cls, runtime: Backend | None = None, *, api_url: str | None = None,
             api_key: str | None = None) -> list[Sandbox]:
        """Every sandbox of the runtime (including hibernated and lost ones), oldest first."""
        rt = _backend(runtime, api_url, api_key)
        return [cls(rt, i.id) for i in rt.list()]

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

    def memory_bytes(self) -> int:
        """Memory charged to the sandbox's processes now, in bytes."""
        return self._rt.memory_bytes(self.id)

    def cpu_seconds(self) -> float:
        """CPU seconds charged to the sandbox's cgroup so far (restarts at 0 after a hibernation)."""
        return self._rt.cpu_seconds(self.id)

    def pause(self) -> None:
        """Freeze every process (no CPU; memory kept). Commands and files are refused until `resume`."""
        self._rt.pause(self.id)

    def resume(self) -> None:
        """Thaw a paused sandbox, or bring a hibernated one back (same id, same processes)."""
        self._rt.resume(self.id)

    def checkpoint(self) -> Checkpoint:
        """Snapshot processes, memory and files into the store; the sandbox keeps running."""
        return Checkpoint._of(self._rt.checkpoint(self.id), self._rt)

    def fork(self, n: int = 1) -> list[Sandbox]:
        """`n` new running sandboxes, each with this one's processes, memory and files as of now."""
        _, kids = self._rt.fork(self.id, n)
        return [Sandbox(self._rt, k.id) for k in kids]

    def hibernate(self) -> Checkpoint:
        """Checkpoint, then stop: memory and CPU released, state "hibernated"; `resume` restores it."""
        return Checkpoint._of(self._rt.hibernate(self.id), self._rt)

    def prefetch(self, ttl_s: float = 60.0) -> bool:
        """Hint that a hibernated sandbox will resume soon: its images are staged in memory now, so
        the `resume` skips reading the store. Returns whether they are staged (False unless
        hibernated); they are dropped after `ttl_s` seconds unless a resume used them."""
        return self._rt.prefetch(self.id, ttl_s)

    def kill(self) -> None:
        """Stop the sandbox and release everything it held (its checkpoints stay in the store)."""
        self._rt.kill(self.id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(NotFoundError):
            self.kill()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sandbox) and other.id == self.id and other._rt is self._rt

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"
