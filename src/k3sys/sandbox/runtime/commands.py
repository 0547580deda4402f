"""Commands in a sandbox, started, watched and signalled by the sandbox's agent (agent.py).

Every command is a child of the agent, the sandbox's PID 1, so a checkpoint, fork, hibernation or
restore carries it along; its output lives in the agent's ring inside the sandbox. The host keeps
only a bounded window of what a reader fetched (window.py): nothing grows on the host while nobody
reads. `run` and the followers of `start_followed` / `follow_command` (follow.py) get every byte:
the agent holds the command back while they read. Commands run without the sandbox's lock, so a
long command never blocks `pause` or `kill`; a call cut by a checkpoint is made again once the
sandbox runs (`Agents.retrying`).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from k3sys.sandbox.errors import (
    AgentError,
    AgentInterruptedError,
    CommandTimeoutError,
    InvalidArgumentError,
    NotFoundError,
    TooLargeError,
)
from k3sys.sandbox.runtime.agent import Agent
from k3sys.sandbox.runtime.agent_protocol import Exit
from k3sys.sandbox.runtime.agents import Agents
from k3sys.sandbox.runtime.drivers.base import Driver
from k3sys.sandbox.runtime.follow import OutputFollower
from k3sys.sandbox.runtime.state import State
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.trees import new_id
from k3sys.sandbox.runtime.window import Window, decode, result
from k3sys.sandbox.spec import CommandResult, OutputPieces, check_command
from k3sys.sandbox.types import ProcessInfo

_log = logging.getLogger(__name__)
# Bytes of output `run` returns, at most: it returns them in the host's memory (a longer output is
# read as it comes, with `stream_command`, or over the service's streams, which hold none of it).
RUN_OUTPUT_MAX = 128 << 20


@dataclass
class _Command:
    sandbox_id: str
    pid: int  # inside the sandbox
    window: Window = field(default_factory=Window)
    mu: threading.Lock = field(default_factory=threading.Lock)  # one fetch at a time


class CommandService:
    """The commands of the sandboxes in `table` (see the module docstring), by command id; `driver`
    runs one where the agent cannot be reached."""

    def __init__(self, table: SandboxTable, agents: Agents, driver: Driver) -> None:
        self.table = table
        self.agents = agents
        self.driver = driver
        self._mu = threading.Lock()  # guards `_commands`
        self._commands: dict[str, _Command] = {}  # command id -> its sandbox and pid

    def start_command(self, sid: str, cmd: str, cwd: str | None = None, env: dict[str, str] | None = None,
                      stdin: bytes | None = None) -> str:
        """Start `sh -c cmd` in the sandbox; returns a command id for `wait_command` / `kill_command`."""
        return self.start_process(sid, cmd, cwd or self.agents.cwd(sid) or "/", env, stdin=stdin)

    def start_process(self, sid: str, cmd: str | list[str], cwd: str | None = None,
                      env: dict[str, str] | None = None, user: str | None = None, stdin: bool | bytes | None = None,
                      pty: tuple[int, int] | None = None) -> str:
        """Start `cmd` (a shell string, or an argv looked up in PATH) as `user` (a name or uid; None:
        the agent's default); `stdin` True: a pipe kept open for `send_stdin`; bytes: written to it,
        then closed; a `pty` = (rows, cols) makes a terminal its stdin, stdout and stderr. Returns a
        command id (`command_pid` gives its pid). `cwd` None: the user's home."""
        return self._start(sid, cmd, cwd, env, user, stdin, pty, follow=False)[0]

    def start_followed(self, sid: str, cmd: str | list[str], cwd: str | None = None,
                       env: dict[str, str] | None = None, user: str | None = None,
                       stdin: bool | bytes | None = None, pty: tuple[int, int] | None = None
                       ) -> tuple[str, OutputFollower]:
        """`start_process`, and its output followed from the first byte (follow.py): the caller reads
        it at its own pace, and the command's writes wait for it. Close the follower when done."""
        cid, follower = self._start(sid, cmd, cwd, env, user, stdin, pty, follow=True)
        assert follower is not None
        return cid, follower

    def _start(self, sid: str, cmd: str | list[str], cwd: str | None, env: dict[str, str] | None, user: str | None,
               stdin: bool | bytes | None, pty: tuple[int, int] | None,
               follow: bool) -> tuple[str, OutputFollower | None]:
        if isinstance(cmd, list) and not (cmd and all(isinstance(a, str) and "\0" not in a for a in cmd) and cmd[0]):
            raise InvalidArgumentError(f"cmd: expected a non-empty argv of strings without NUL, got {cmd!r}")
        env = check_command(cmd[0] if isinstance(cmd, list) else cmd, cwd, env)
        if pty is not None and not all(isinstance(n, int) and 0 < n < 1 << 16 for n in pty):
            raise InvalidArgumentError(f"pty: expected (rows, cols) between 1 and 65535, got {pty!r}")
        piped = stdin is True or isinstance(stdin, bytes)
        follower = None
        with self.table.locked(sid) as rec:
            self.table.require(rec, "run a command in", State.RUNNING)
            agent = self.agents.get(sid)
            if follow:
                fields = agent.start_fields(cmd, env, cwd, user, piped, pty, None)
                follower = OutputFollower(agent, "start", [*fields, ("follow", 1)])
                pid = follower.pid
            else:
                pid = agent.start(cmd, env=env, cwd=cwd, user=user, pty=pty, stdin=piped)
        if isinstance(stdin, bytes):
            # On a thread: a command that does not read its stdin would block a write past the pipe's
            # buffer, and with it this call and the timeout the caller's wait is about to start.
            threading.Thread(target=self._feed, args=(sid, pid, stdin), daemon=True).start()
        return self._register_command(sid, pid), follower

    def follow_command(self, cid: str, pos: int = 0) -> OutputFollower:
        """The command's output from offset `pos`, followed (follow.py); waits out a checkpoint."""
        c = self._command(cid)
        fields = [("pid", c.pid), ("from", pos), ("follow", 1)]
        return self.agents.retrying(c.sandbox_id, lambda a: OutputFollower(a, "connect", fields, pos))

    def send_stdin(self, sid: str, pid: int, data: bytes, close: bool = False) -> None:
        """Write `data` to process `pid`'s stdin (a pipe or its terminal); `close` then closes it
        (a terminal gets ^D). NotFoundError when there is no such process."""
        if data:
            self.agents.retrying(sid, lambda a: a.write_stdin(pid, data))
        if close:
            self.agents.retrying(sid, lambda a: a.close_stdin(pid))

    def signal_process(self, sid: str, pid: int, sig: int) -> None:
        """Send signal `sig` to process `pid`'s group in the sandbox; a SIGKILL waits (up to 10 s)
        for the process to end, so it is no longer running once this returns."""
        self.agents.retrying(sid, lambda a: a.signal(pid, sig))
        if sig == 9:
            with contextlib.suppress(NotFoundError):  # ended, and collected at once by a stream that followed it
                self.agents.retrying(sid, lambda a: a.wait(pid, 10))

    def resize_pty(self, sid: str, pid: int, rows: int, cols: int) -> None:
        """Resize the terminal of PTY process `pid` (`rows` x `cols` characters)."""
        if not all(isinstance(n, int) and 0 < n < 1 << 16 for n in (rows, cols)):
            raise InvalidArgumentError(f"pty size: expected rows and cols between 1 and 65535, got {rows}x{cols}")
        self.agents.retrying(sid, lambda a: a.resize(pid, rows, cols))

    def command_exit(self, cid: str) -> Exit | None:
        """How the command ended, once it did and its output was all read (else None)."""
        return self._command(cid).window.end

    def release_command(self, cid: str) -> None:
        """Forget the command id and free its process's record in the agent (once it has ended)."""
        self._forget(cid, self._command(cid))

    def forget_command(self, cid: str) -> None:
        """Forget the command id only: its process runs on, and `connect_command` finds it again."""
        with self._mu:
            self._commands.pop(cid, None)

    def _register_command(self, sid: str, pid: int) -> str:
        cid = new_id("cmd")
        with self._mu:
            self._commands[cid] = _Command(sid, pid)
        return cid

    def connect_command(self, sid: str, pid: int) -> str:
        """A command id for process `pid` of the sandbox, running or ended and not yet released: a
        background command seen again in a fork, a restored sandbox or after a runtime restart."""
        procs = self.agents.retrying(sid, lambda a: a.processes())
        if not any(p["pid"] == str(pid) for p in procs):
            raise NotFoundError(f"no process {pid} in sandbox {sid}")
        return self._register_command(sid, pid)

    def processes(self, sid: str) -> list[ProcessInfo]:
        """The processes the sandbox's agent started and still holds, by pid."""
        procs = self.agents.retrying(sid, lambda a: a.processes())
        return sorted((ProcessInfo(int(p["pid"]), p.get("cmd", ""), p.get("tag", ""), p.get("running") == "1",
                                   int(p["exit"]) if "exit" in p else None, p.get("pty", "0") not in ("", "0"))
                       for p in procs), key=lambda p: p.pid)

    def command_pid(self, cid: str) -> int:
        """The command's pid inside its sandbox (for `connect_command` in a fork or restore)."""
        return self._command(cid).pid

    def _feed(self, sid: str, pid: int, data: bytes) -> None:
        """Write a command's whole stdin and close it (a command that exits early just gets less)."""
        with contextlib.suppress(AgentError, NotFoundError):
            self.agents.retrying(sid, lambda a: a.write_stdin(pid, data))
            self.agents.retrying(sid, lambda a: a.close_stdin(pid))

    def _command(self, cid: str) -> _Command:
        with self._mu:
            c = self._commands.get(cid)
        if c is None:
            raise NotFoundError(f"no command {cid!r}")
        return c

    def _fetch(self, c: _Command, follow: bool = False, timeout: float | None = None) -> Window:
        """Bring `c`'s window up to date (with `follow`, until the command ends)."""
        w = c.window
        with c.mu:
            if w.end is None:
                def more(a: Agent) -> None:
                    for piece in a.output(c.pid, w.pos, follow=follow, timeout=timeout):
                        w.add(piece)
                try:
                    self.agents.retrying(c.sandbox_id, more)
                except AgentError:
                    if not self._killed(c):
                        raise
                    w.end = Exit(137, 9, 0, w.pos)  # the sandbox was killed under it
        return w

    def _killed(self, c: _Command) -> bool:
        return self.table.get(c.sandbox_id) is None

    def wait_command(self, cid: str, timeout: float | None = None) -> CommandResult:
        """Wait for the command to end; on `timeout` (seconds) kill it and raise CommandTimeoutError."""
        c = self._command(cid)
        try:
            w = self._fetch(c, follow=True, timeout=timeout)
        except CommandTimeoutError:
            self.kill_command(cid)
            w = self._fetch(c)
            out, err = w.since(0, 0)
            raise CommandTimeoutError(f"command {cid} in sandbox {c.sandbox_id} ran past {timeout} s and was killed",
                                      decode(out), decode(err)) from None
        self._forget(cid, c)
        assert w.end is not None
        out, err = w.since(0, 0)
        return result(out, err, w.end, w.end.end - len(out) - len(err))

    def _forget(self, cid: str, c: _Command) -> None:
        with self._mu:
            self._commands.pop(cid, None)
        if not self._killed(c):
            with contextlib.suppress(AgentError, NotFoundError):
                self.agents.get(c.sandbox_id).release(c.pid)

    def command_output(self, cid: str) -> tuple[str, str]:
        """What the command has written so far (stdout, stderr), as far as the host's window holds."""
        c = self._command(cid)
        w = self._fetch(c)
        out, err = w.since(0, 0)
        return decode(out), decode(err)

    def read_command_output(self, cid: str, since: tuple[int, int] = (0, 0)) -> tuple[bytes, bytes, bool]:
        """Raw (stdout, stderr) bytes after the offsets `since`, and whether the command has ended with
        all its output read. Waits only for the sandbox's agent (a checkpoint in progress)."""
        w = self._fetch(self._command(cid))
        return *w.since(*since), w.end is not None

    def stream_command(self, cid: str, poll: float = 0.02) -> Iterator[tuple[str, str]]:
        """Yield `("stdout" | "stderr", text)` as the command writes it (from its start), until it ends;
        `poll` seconds between looks. `wait_command` still gives the exit code afterwards."""
        pieces = OutputPieces()
        while True:
            out, err, done = self.read_command_output(cid, pieces.offsets)
            yield from pieces.feed(out, err, final=done)
            if done:
                return
            time.sleep(poll)

    def command_running(self, cid: str) -> bool:
        return self._fetch(self._command(cid)).end is None

    def kill_command(self, cid: str) -> None:
        """SIGKILL the command and everything it started (its process group)."""
        c = self._command(cid)
        if self._killed(c):
            return
        with contextlib.suppress(NotFoundError):
            self.signal_process(c.sandbox_id, c.pid, 9)

    def run(self, sid: str, cmd: str, timeout: float | None = 60, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: bytes | None = None) -> CommandResult:
        """Run `sh -c cmd` to completion: one round trip to the agent (start and follow), unless it
        has input for its stdin (then `start_command` and `wait_command`). All its output, held back
        in the sandbox while this reads; past RUN_OUTPUT_MAX bytes it is killed (TooLargeError)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
            raise InvalidArgumentError(f"timeout: expected None or a positive number of seconds, got {timeout!r}")
        if stdin is None:
            env = check_command(cmd, cwd, env)
            with self.table.locked(sid) as rec:
                self.table.require(rec, "run a command in", State.RUNNING)
                agent = self.agents.get(sid)
            try:
                out, end = agent.run(cmd, env=env, cwd=cwd or agent.cwd or "/", timeout=timeout, limit=RUN_OUTPUT_MAX)
            except CommandTimeoutError as e:
                raise CommandTimeoutError(f"command in sandbox {sid} ran past {timeout} s and was killed",
                                          e.stdout, e.stderr) from None
            except AgentInterruptedError:
                raise
            except AgentError as e:
                if "unreachable" not in str(e):
                    raise
                return self._run_without_agent(sid, cmd, timeout, cwd, env, e)
            if end.end > RUN_OUTPUT_MAX:
                raise TooLargeError(f"command in sandbox {sid} wrote more than {RUN_OUTPUT_MAX} bytes and was "
                                    "killed: read longer output as it comes (start_command, stream_command)")
            return result(out.text("stdout"), out.text("stderr"), end, out.dropped)
        cid = self.start_command(sid, cmd, cwd, env, stdin)
        try:
            return self.wait_command(cid, timeout)
        finally:
            self.forget_command(cid)

    def _run_without_agent(self, sid: str, cmd: str, timeout: float | None, cwd: str | None,
                           env: dict[str, str] | None, why: AgentError) -> CommandResult:
        """The fallback for a sandbox whose agent cannot be reached (its socket removed from inside,
        say): `runc exec`, ~10 ms, output held in host memory, and the command is not a child of PID 1
        (a checkpoint does not carry it)."""
        _log.warning("sandbox %s: %s; running %r through runc exec", sid, why, cmd)
        proc, _ = self.driver.exec(sid, ["/bin/sh", "-c", cmd], cwd or "/", dict(env or {}), False)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise CommandTimeoutError(f"command in sandbox {sid} ran past {timeout} s and was killed "
                                      f"(run through runc exec: {why})", decode(out), decode(err)) from None
        return CommandResult(decode(out), decode(err), proc.returncode)
