"""`sbx.commands` and the handle of a background command, in E2B's call shapes:

    r = sbx.commands.run("make", envs={"CC": "gcc"}, cwd="/src", user="root", timeout=600)
    h = sbx.commands.run("tail -f log", background=True)   # CommandHandle
    for stdout, stderr, pty in h: ...                       # E2B's tuples, one of the three set
    h.wait(on_stdout=print)                                 # CommandResult, or CommandExitError

A command that exits non-zero raises `CommandExitError` (E2B's `CommandExitException`, carrying the
result's fields), from `run` and from `wait`, as E2B's SDK does. k3sys's earlier names stay: `env=`
(E2B's `envs=`), `stdin=` bytes or str (written to the command, then closed; E2B's `stdin=True`
keeps a pipe open for `send_stdin`), `wait(timeout)`, `stream()` (`(stream name, text)` pieces),
`output()`, `running`.

Each call is described once, in `Commands` (see api.py's `_then`); `AsyncCommands` awaits the same
descriptions, and `CommandHandle` and `AsyncCommandHandle` are siblings over `_CommandHandleBase`,
so every class's hints say what it returns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from k3sys.sandbox.errors import CommandExitError, InvalidArgumentError, NotFoundError
from k3sys.sandbox.spec import CommandResult
from k3sys.sandbox.types import ProcessInfo

OnOutput = Callable[[str], Any] | None
Event = tuple[str | None, str | None, bytes | None]  # E2B's (stdout, stderr, pty): one of them set


def checked(r: CommandResult) -> CommandResult:
    """`r`, or CommandExitError with its fields when the command exited non-zero (E2B's rule)."""
    if r.exit_code != 0:
        raise CommandExitError("", r.stdout, r.stderr, r.exit_code, r.error)
    return r


def _event(name: str, text: str) -> Event:
    return (text, None, None) if name == "stdout" else (None, text, None)


def _wait_timeout(on_pty: Any, timeout: float | None) -> tuple[Any, float | None]:
    """k3sys's `wait(10)`: a number where E2B has `on_pty` is the old positional timeout."""
    if isinstance(on_pty, int | float) and not isinstance(on_pty, bool):
        return None, on_pty
    return on_pty, timeout


class _CommandHandleBase:
    """What both handles share: the command's id on its backend, and the run's timeout (seconds)."""

    def __init__(self, runtime: Any, cid: str, timeout: float | None = None) -> None:
        self._rt = runtime
        self.id = cid
        self._timeout = timeout or None  # E2B: 0 is no limit
        self._pid: Any = None

    @property
    def pid(self) -> Any:
        """The command's pid inside the sandbox (what `commands.connect` takes, here or in a fork);
        asked once, so it is still known after `wait` let the command go (through an
        `AsyncCommandHandle`, an awaitable)."""
        if self._pid is None:
            self._pid = self._rt.command_pid(self.id)
        return self._pid

    def output(self) -> Any:
        """(stdout, stderr) written so far."""
        return self._rt.command_output(self.id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


class CommandHandle(_CommandHandleBase):
    """A command started with `background=True`: iterate it for E2B's `(stdout, stderr, pty)`
    events, `wait` for its result, `kill` it, `disconnect` to stop following it."""

    def __init__(self, runtime: Any, cid: str, timeout: float | None = None) -> None:
        super().__init__(runtime, cid, timeout)
        self._events: Iterator[tuple[str, str]] | None = None

    def __iter__(self) -> Iterator[Event]:
        self._events = self._rt.stream_command(self.id)
        for name, text in self._events:
            yield _event(name, text)

    def stream(self) -> Iterator[tuple[str, str]]:
        """`("stdout" | "stderr", text)` pieces from the command's start until it ends."""
        return self._rt.stream_command(self.id)

    def disconnect(self) -> None:
        """Stop following the output (an iteration in progress ends); the command keeps running."""
        if self._events is not None and hasattr(self._events, "close"):
            self._events.close()

    def wait(self, on_pty: Any = None, on_stdout: OnOutput = None, on_stderr: OnOutput = None, *,
             timeout: float | None = None) -> CommandResult:
        """Block until the command ends, handing its output to the callbacks as it comes; its
        CommandResult, or CommandExitError if it exited non-zero. Past `timeout` s (default: the
        run's) it is killed and CommandTimeoutError raised."""
        on_pty, timeout = _wait_timeout(on_pty, timeout)
        if on_stdout or on_stderr:
            for out, err, _ in self:
                if out is not None and on_stdout:
                    on_stdout(out)
                elif err is not None and on_stderr:
                    on_stderr(err)
        return checked(self._rt.wait_command(self.id, timeout if timeout is not None else self._timeout))

    def kill(self) -> bool:
        """SIGKILL the command and what it started; False if it was gone already."""
        try:
            self._rt.kill_command(self.id)
        except NotFoundError:
            return False
        return True

    @property
    def running(self) -> bool:
        return self._rt.command_running(self.id)


class AsyncCommandHandle(_CommandHandleBase):
    """`CommandHandle` for asyncio: `async for stdout, stderr, pty in h`, `await h.wait()`."""

    def __init__(self, runtime: Any, cid: str, timeout: float | None = None) -> None:
        super().__init__(runtime, cid, timeout)
        self._events: AsyncIterator[tuple[str, str]] | None = None

    async def __aiter__(self) -> AsyncIterator[Event]:
        self._events = self._rt.stream_command(self.id)
        async for name, text in self._events:
            yield _event(name, text)

    def stream(self) -> AsyncIterator[tuple[str, str]]:
        return self._rt.stream_command(self.id)

    async def disconnect(self) -> None:
        if self._events is not None and hasattr(self._events, "aclose"):
            await self._events.aclose()

    async def wait(self, on_pty: Any = None, on_stdout: OnOutput = None, on_stderr: OnOutput = None, *,
                   timeout: float | None = None) -> CommandResult:
        on_pty, timeout = _wait_timeout(on_pty, timeout)
        if on_stdout or on_stderr:
            async for out, err, _ in self:
                if out is not None and on_stdout:
                    on_stdout(out)
                elif err is not None and on_stderr:
                    on_stderr(err)
        return checked(await self._rt.wait_command(self.id, timeout if timeout is not None else self._timeout))

    async def kill(self) -> bool:
        try:
            await self._rt.kill_command(self.id)
        except NotFoundError:
            return False
        return True

    async def running(self) -> bool:
        return await self._rt.command_running(self.id)


class Commands:
    """`sbx.commands`: run shell commands in the sandbox. Each call is described here once; through
    an `AsyncSandbox` the same description gives awaitables, which `AsyncCommands` awaits."""

    def __init__(self, sandbox: Any) -> None:  # api.py's _Facade (api.py imports this module)
        self._sbx = sandbox

    def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
            user: str | None = None, cwd: str | None = None, on_stdout: OnOutput = None,
            on_stderr: OnOutput = None, stdin: bool | bytes | str | None = None, timeout: float | None = 60,
            request_timeout: float | None = None, *, env: dict[str, str] | None = None
            ) -> CommandResult | CommandHandle:
        """Run `sh -c cmd`: its CommandResult (CommandExitError if it exits non-zero), or with
        `background` its CommandHandle at once. `envs` are added to the sandbox's own (`create(envs=)`),
        `user` runs it as that user (None: the template's default), `cwd` None: "/". `stdin` True
        keeps its stdin open (`send_stdin`); bytes or str are written to it, then it is closed.
        `timeout` s (None or 0: no limit) kills it past that (CommandTimeoutError). `request_timeout`
        is accepted for E2B's signature: an embedded call has no request to time."""
        if env is not None and envs is not None:
            raise InvalidArgumentError("envs: give either envs= or its old name env=, not both")
        sbx, rt = self._sbx, self._sbx._rt
        variables = {**sbx._envs(), **(envs if envs is not None else env or {})}
        data = stdin.encode() if isinstance(stdin, str) else None if isinstance(stdin, bool) else stdin
        timeout = timeout or None
        if not (background or on_stdout or on_stderr or user is not None or stdin is True):
            return sbx._then(rt.run(sbx.id, cmd, timeout, cwd, variables, data), checked)
        if user is None and stdin is not True:
            started = rt.start_command(sbx.id, cmd, cwd, variables, data)
        else:  # the embedded runtime's call with a user and an open stdin
            started = rt.start_process(sbx.id, cmd, cwd or "/", variables, user, True if stdin is True else data)
        handle = sbx._then(started, lambda cid: sbx._handle(rt, cid, timeout))
        if background:
            return handle
        return sbx._chain(handle, lambda h: h.wait(on_stdout=on_stdout, on_stderr=on_stderr))

    def list(self, request_timeout: float | None = None) -> list[ProcessInfo]:
        """The processes the sandbox's agent started and still holds, by pid."""
        return self._sbx._rt.processes(self._sbx.id)

    def connect(self, pid: int, timeout: float | None = 60, request_timeout: float | None = None) -> CommandHandle:
        """A CommandHandle on process `pid` (from `list` or a handle's `pid`), here or in a fork or
        restore of the sandbox that started it, with its earlier and new output."""
        sbx = self._sbx
        return sbx._then(sbx._rt.connect_command(sbx.id, pid), lambda cid: sbx._handle(sbx._rt, cid, timeout))

    def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        """SIGKILL process `pid`: True, or False if there is none."""
        sbx, rt = self._sbx, self._sbx._rt
        return sbx._found(lambda: sbx._chain(rt.connect_command(sbx.id, pid), rt.kill_command))

    def send_stdin(self, pid: int, data: str | bytes, request_timeout: float | None = None) -> None:
        """Write to the stdin of a command started with `stdin=True` (embedded runtime)."""
        return self._sbx._rt.send_stdin(self._sbx.id, pid, data.encode() if isinstance(data, str) else data)

    def close_stdin(self, pid: int, request_timeout: float | None = None) -> None:
        return self._sbx._rt.send_stdin(self._sbx.id, pid, b"", True)



def _awaited(value: object) -> Awaitable[Any]:
    """A `Commands` answer on an asyncio facade: an awaitable, whatever the sync hint says."""
    return value  # type: ignore[return-value]


class AsyncCommands:
    """`AsyncSandbox.commands`: `Commands`' calls as coroutines (see `Commands` for each)."""

    def __init__(self, sandbox: Any) -> None:  # api.py's _Facade (api.py imports this module)
        self._calls = Commands(sandbox)

    async def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
                  user: str | None = None, cwd: str | None = None, on_stdout: OnOutput = None,
                  on_stderr: OnOutput = None, stdin: bool | bytes | str | None = None, timeout: float | None = 60,
                  request_timeout: float | None = None, *, env: dict[str, str] | None = None
                  ) -> CommandResult | AsyncCommandHandle:
        return await _awaited(self._calls.run(cmd, background, envs, user, cwd, on_stdout, on_stderr, stdin, timeout,
                                              request_timeout, env=env))

    async def list(self, request_timeout: float | None = None) -> list[ProcessInfo]:
        return await _awaited(self._calls.list(request_timeout))

    async def connect(self, pid: int, timeout: float | None = 60,
                      request_timeout: float | None = None) -> AsyncCommandHandle:
        return await _awaited(self._calls.connect(pid, timeout, request_timeout))

    async def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        return await _awaited(self._calls.kill(pid, request_timeout))

    async def send_stdin(self, pid: int, data: str | bytes, request_timeout: float | None = None) -> None:
        return await _awaited(self._calls.send_stdin(pid, data, request_timeout))

    async def close_stdin(self, pid: int, request_timeout: float | None = None) -> None:
        return await _awaited(self._calls.close_stdin(pid, request_timeout))
