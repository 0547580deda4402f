"""Commands in a sandbox: `sh -c` started through the driver, their output pumped into memory by a
thread per pipe, waited on, streamed, killed with everything they started. Commands run without the
sandbox's lock, so a long command never blocks `pause` or `kill`."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from k3sys.sandbox.errors import (
    CommandTimeoutError,
    InvalidArgumentError,
    NotFoundError,
)
from k3sys.sandbox.runtime.state import State
from k3sys.sandbox.runtime.table import Table, _new_id
from k3sys.sandbox.spec import CommandResult, OutputPieces


@dataclass
class _Command:
    sandbox_id: str
    proc: subprocess.Popen
    pid: int
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    readers: list[threading.Thread] = field(default_factory=list)


def _decode(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


def _pump(stream: Any, buf: bytearray) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        buf += chunk
    stream.close()


def _feed(stream: Any, data: bytes) -> None:
    """Write a command's whole stdin and close it (a command that exits early just gets less)."""
    with contextlib.suppress(BrokenPipeError, OSError):
        stream.write(data)
    with contextlib.suppress(BrokenPipeError, OSError):
        stream.close()


class Commands(Table):
    """`Runtime`'s commands (see the module docstring)."""

    _commands: dict[str, _Command]

    def start_command(self, sid: str, cmd: str, cwd: str | None = None, env: dict[str, str] | None = None,
                      stdin: bytes | None = None) -> str:
        """Start `sh -c cmd` in the sandbox; returns a command id for `wait_command` / `kill_command`."""
        if not isinstance(cmd, str) or not cmd:
            raise InvalidArgumentError(f"cmd: expected a non-empty string, got {cmd!r}")
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise InvalidArgumentError(f"cwd: expected an absolute path in the sandbox, got {cwd!r}")
        env = dict(env or {})
        for k, v in env.items():
            if not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str) or "\0" in v:
                raise InvalidArgumentError(f"env: bad variable {k!r}={v!r}")
        with self._locked(sid) as rec:
            self._require(rec, "run a command in", State.RUNNING)
            proc, pid = self.driver.exec(sid, ["/bin/sh", "-c", cmd], cwd or "/", env, stdin is not None)
        c = _Command(sid, proc, pid)
        for stream, buf in ((proc.stdout, c.out), (proc.stderr, c.err)):
            t = threading.Thread(target=_pump, args=(stream, buf), daemon=True)
            t.start()
            c.readers.append(t)
        if stdin is not None:
            # On a thread: a command that does not read its stdin would block a write past the pipe's
            # buffer, and with it this call and the timeout the caller's wait is about to start.
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
        cid = _new_id("cmd")
        with self._mu:
            self._commands[cid] = c
        return cid

    def _command(self, cid: str) -> _Command:
        with self._mu:
            c = self._commands.get(cid)
        if c is None:
            raise NotFoundError(f"no command {cid!r}")
        return c

    def wait_command(self, cid: str, timeout: float | None = None) -> CommandResult:
        """Wait for the command to end; on `timeout` (seconds) kill it and raise CommandTimeoutError."""
        c = self._command(cid)
        try:
            code = c.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_command(cid)
            for t in c.readers:  # what was still in the pipes belongs to the partial output
                t.join(1)
            out, err = bytes(c.out), bytes(c.err)
            raise CommandTimeoutError(f"command {cid} in sandbox {c.sandbox_id} ran past {timeout} s and was killed",
                                      _decode(out), _decode(err)) from None
        for t in c.readers:
            t.join()
        with self._mu:
            self._commands.pop(cid, None)
        return CommandResult(_decode(bytes(c.out)), _decode(bytes(c.err)), code)

    def command_output(self, cid: str) -> tuple[str, str]:
        """What the command has written so far (stdout, stderr)."""
        c = self._command(cid)
        return _decode(bytes(c.out)), _decode(bytes(c.err))

    def read_command_output(self, cid: str, since: tuple[int, int] = (0, 0)) -> tuple[bytes, bytes, bool]:
        """Raw (stdout, stderr) bytes after the offsets `since`, and whether the command has ended with
        all its output read. Never blocks."""
        c = self._command(cid)
        # Checked before reading, so whatever the command wrote before ending is in this answer.
        done = c.proc.poll() is not None and not any(t.is_alive() for t in c.readers)
        return bytes(c.out[since[0]:]), bytes(c.err[since[1]:]), done

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
        return self._command(cid).proc.poll() is None

    def kill_command(self, cid: str) -> None:
        """SIGKILL the command and everything it started (still its descendants)."""
        c = self._command(cid)
        self._kill_tree(c)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(10)

    def _kill_tree(self, c: _Command) -> None:
        if c.proc.poll() is None:
            if c.pid:
                self.driver.kill_tree(c.pid)
            with contextlib.suppress(ProcessLookupError):
                c.proc.kill()  # runc exec itself, once the command is gone

    def run(self, sid: str, cmd: str, timeout: float | None = 60, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: bytes | None = None) -> CommandResult:
        """Run `sh -c cmd` to completion (see `start_command`, `wait_command`)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
            raise InvalidArgumentError(f"timeout: expected None or a positive number of seconds, got {timeout!r}")
        cid = self.start_command(sid, cmd, cwd, env, stdin)
        try:
            return self.wait_command(cid, timeout)
        finally:
            with self._mu:
                self._commands.pop(cid, None)

    def _kill_commands(self, sid: str) -> None:
        with self._mu:
            mine = [(k, c) for k, c in self._commands.items() if c.sandbox_id == sid]
        for _, c in mine:
            self._kill_tree(c)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(5)
        # Handles stay valid (wait() reports the kill) until their owner drops them.
