"""Client of `k3sys-agent`, the sandbox's PID 1 (agent/; docs/sandbox-agent.md): its requests for
processes and files. The connection under them (the peer check, the deadlines every call carries,
the gate a checkpoint closes) is agent_link.py; the wire format agent_protocol.py. Output streams
reconnect by themselves from the byte offset they had reached, so a follower only sees a pause.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from k3sys.sandbox.errors import (
    AgentInterruptedError,
    CommandTimeoutError,
    InvalidArgumentError,
    SandboxError,
)
from k3sys.sandbox.runtime.agent_link import SOCKET, AgentLink, Deadlines
from k3sys.sandbox.runtime.agent_protocol import Exit, Gap, Output, encode, parse_fields, xattr_fields

__all__ = ["SOCKET", "Agent", "Deadlines"]


class Agent(AgentLink):
    """The agent of one sandbox (see `AgentLink` for the arguments)."""

    def __init__(self, root: Path, pid: Callable[[], int | None] = lambda: None, *, sandbox: str = "",
                 deadlines: Deadlines | None = None, frozen: Callable[[], bool] = lambda: False) -> None:
        super().__init__(root, pid, sandbox=sandbox, deadlines=deadlines, frozen=frozen)
        # Who a start or file call that names no user runs as, the variables a start gets under its
        # own, and where one that names no directory starts: its template's defaults
        # (templates.template_defaults, set by the runtime); None leaves it to the agent (root, home).
        self.user: str | None = None
        self.env: dict[str, str] = {}
        self.cwd: str | None = None

    def _request(self, op: str, fields: Iterable[tuple[str, object]] = (),
                 timeout: float | None = None) -> dict[str, str]:
        with self.connection(timeout or self.deadlines.answer) as st:
            st.send(encode(op, fields))
            return st.result()

    # --- processes ----------------------------------------------------------------------------

    def start_fields(self, cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, user: str | None,
                      stdin: bool, pty: tuple[int, int] | None, ring: int | None) -> list[tuple[str, object]]:
        f: list[tuple[str, object]] = [("cmd", cmd)] if isinstance(cmd, str) else [("arg", a) for a in cmd]
        f += [("env", f"{k}={v}") for k, v in {**self.env, **(env or {})}.items()]
        f += [("cwd", cwd or self.cwd), ("user", self.user if user is None else user), ("stdin", stdin),
              ("ring", ring)]
        if pty:
            f.append(("pty", f"{pty[0]}x{pty[1]}"))
        return f

    def start(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
              user: str | None = None, stdin: bool = False, pty: tuple[int, int] | None = None,
              ring: int | None = None) -> int:
        """Start `cmd` (a shell string for `/bin/sh -c`, or an argv); its pid inside the sandbox.
        `pty` = (rows, cols) runs it on a terminal; `ring` bounds its kept output (bytes)."""
        return int(self._request("start", self.start_fields(cmd, env, cwd, user, stdin, pty, ring))["pid"])

    def run(self, cmd: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
            user: str | None = None, timeout: float | None = None, limit: int | None = None) -> tuple[Output, Exit]:
        """Run `cmd` to its end in one round trip (start and follow): all its output (the agent holds
        its writes while this reads) and how it ended. The agent kills it past `limit` bytes (then the
        Exit's `end` is past it); on `timeout` (s) CommandTimeoutError carries the output so far."""
        out = Output(None)
        tag = secrets.token_hex(8)  # names this start, so a cut call finds its process, never starts two
        fields = [*self.start_fields(cmd, env, cwd, user, False, None, None), ("follow", 1), ("release", 1),
                  ("tag", tag), ("max", limit)]
        deadline = None if timeout is None else time.monotonic() + timeout
        pid = 0
        try:
            with self.connection(timeout, command=True) as st:
                st.send(encode("start", fields))
                for t, payload in st.frames():
                    if t == "I":
                        f = parse_fields(payload)
                        if not pid and "pid" in f:
                            pid = int(f["pid"])
                            self.mark_streaming(st.sock)  # started: from here on it follows the output
                        out.dropped += int(f.get("dropped", 0))
                    elif t in "OE":
                        out.add("stdout" if t == "O" else "stderr", payload)
                    elif t == "R":
                        f = parse_fields(payload)
                        return out, Exit(int(f["exit"]), int(f.get("signal", 0)), out.dropped, int(f["end"]))
        except CommandTimeoutError:
            if not pid:
                self._probe()  # no start within `timeout`: a stuck agent says so (AgentTimeoutError)
                raise
            self._kill_quietly(pid)
            raise CommandTimeoutError(f"command ran past {timeout} s and was killed",
                                      out.text("stdout").decode(errors="replace"),
                                      out.text("stderr").decode(errors="replace")) from None
        except AgentInterruptedError:
            # Cut by a checkpoint; whether the start got through is in the agent's table.
            pid = pid or next((int(p["pid"]) for p in self.processes() if p.get("tag") == tag), 0)
            if not pid:
                rest = None if deadline is None else max(0.001, deadline - time.monotonic())
                return self.run(cmd, env=env, cwd=cwd, user=user, timeout=rest, limit=limit)
        # The process runs on inside; follow it again from where the stream was cut.
        rest = None if deadline is None else max(0.001, deadline - time.monotonic())
        end = self.follow(pid, out, out.size + out.dropped, timeout=rest)
        self._kill_quietly(pid, release_only=True)
        return out, end

    def _kill_quietly(self, pid: int, release_only: bool = False) -> None:
        with contextlib.suppress(SandboxError):
            if not release_only:
                self.signal(pid, 9)
            self.release(pid)

    def follow(self, pid: int, out: Output, pos: int = 0, timeout: float | None = None) -> Exit:
        """Add `pid`'s output from offset `pos` to `out` until it ends; reconnects after a checkpoint
        cut the stream, from where it was."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rest = None if deadline is None else deadline - time.monotonic()
            if rest is not None and rest <= 0:
                raise CommandTimeoutError(f"process {pid} still running after {timeout} s")
            try:
                for piece in self.output(pid, pos, follow=True, timeout=rest):
                    if isinstance(piece, Exit):
                        return piece
                    if isinstance(piece, Gap):
                        out.dropped += piece.n
                        pos += piece.n
                    else:
                        out.add(*piece)
                        pos += len(piece[1])
            except AgentInterruptedError:
                continue

    def output(self, pid: int, pos: int = 0, *, follow: bool = False,
               timeout: float | None = None) -> Iterator[tuple[str, bytes] | Gap | Exit]:
        """`pid`'s output from byte offset `pos` as ("stdout" | "stderr", bytes) pieces, a Gap where
        the ring dropped bytes, then its Exit once ended. Without `follow`: what is there now (no
        Exit while it runs). Pieces and gaps advance the offset by their length."""
        with self.connection(timeout, stream=follow, command=True) as st:
            st.send(encode("connect", [("pid", pid), ("from", pos), ("follow", follow)]))
            for t, payload in st.frames():
                if t in "OE":
                    yield ("stdout" if t == "O" else "stderr"), payload
                elif t == "I":
                    yield Gap(int(parse_fields(payload).get("dropped", 0)))
                elif t == "R":
                    f = parse_fields(payload)
                    if "exit" in f:
                        yield Exit(int(f["exit"]), int(f.get("signal", 0)), int(f["dropped"]), int(f["end"]))

    def wait(self, pid: int, timeout: float | None = None) -> Exit:
        ms = None if timeout is None else max(1, int(timeout * 1000))
        with self.connection(None if timeout is None else timeout + 5, stream=True) as st:
            st.send(encode("wait", [("pid", pid), ("timeout", ms)]))
            f = st.result()
        return Exit(int(f["exit"]), int(f.get("signal", 0)), int(f["dropped"]), int(f["end"]))

    def signal(self, pid: int, sig: int, group: bool = True) -> None:
        self._request("signal", [("pid", pid), ("sig", sig), ("group", group)])

    def write_stdin(self, pid: int, data: bytes) -> None:
        with self.connection(self.deadlines.answer) as st:
            st.send(encode("stdin", [("pid", pid)]))
            st.data(data)
            st.end()
            st.result()

    def close_stdin(self, pid: int) -> None:
        self._request("stdin", [("pid", pid), ("close", 1)])

    def resize(self, pid: int, rows: int, cols: int) -> None:
        self._request("resize", [("pid", pid), ("rows", rows), ("cols", cols)])

    def release(self, pid: int) -> None:
        """Free `pid`'s record and output once it has ended (now, if it has)."""
        self._request("release", [("pid", pid)])

    def processes(self) -> list[dict[str, str]]:
        with self.connection(self.deadlines.answer) as st:
            st.send(encode("ps", ()))
            return [parse_fields(p) for t, p in st.frames() if t == "I"]

    def ping(self) -> dict[str, str]:
        return self._request("ping", timeout=5)

    # --- files --------------------------------------------------------------------------------

    def _file_fields(self, path: str, user: str | None, timeout: float | None) -> list[tuple[str, object]]:
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidArgumentError(f"path: expected an absolute path in the sandbox, got {path!r}")
        return [("path", path), ("user", self.user if user is None else user),
                ("timeout", int((timeout or self.deadlines.answer) * 1000))]

    def read_chunks(self, path: str, *, user: str | None = None, offset: int = 0, max_bytes: int | None = None,
                    timeout: float | None = None) -> Iterator[bytes]:
        """The file's bytes from `offset` as the agent sends them (a regular file: up to the size it
        had when opened; anything else until its end or `max_bytes`)."""
        with self.connection((timeout or self.deadlines.answer) + 5) as st:
            st.send(encode("read", [*self._file_fields(path, user, timeout), ("offset", offset),
                                     ("max", max_bytes)]))
            for t, payload in st.frames():
                if t == "D":
                    yield payload

    def read(self, path: str, **kw: object) -> bytes:
        return b"".join(self.read_chunks(path, **kw))  # type: ignore[arg-type]

    def write(self, path: str, data: bytes | Iterable[bytes], *, user: str | None = None, mode: int | None = None,
              parents: bool = False, timeout: float | None = None, xattrs: dict[str, bytes] | None = None) -> int:
        """Replace the file at `path` (atomically; a FIFO or device is written as the sandbox would),
        with `parents` creating missing directories first, `xattrs` (user.*) set on the new file before
        it replaces the old one; returns the bytes written."""
        fields = [*self._file_fields(path, user, timeout), ("mode", mode), ("parents", parents), *xattr_fields(xattrs)]
        with self.connection((timeout or self.deadlines.answer) + 5) as st:
            st.send(encode("write", fields))
            for chunk in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
                st.data(bytes(chunk))
            st.end()
            return int(st.result()["size"])

    def setxattr(self, path: str, xattrs: dict[str, bytes], *, user: str | None = None) -> None:
        """Set user.* extended attributes of `path` (a symlink's target) inside the sandbox."""
        self._request("setxattr", [*self._file_fields(path, user, None), *xattr_fields(xattrs)])

    def stat(self, path: str, *, user: str | None = None, follow: bool = False, xattrs: bool = False) -> dict[str, str]:
        """The entry fields of `path` (of a symlink's target with `follow`), its user.* `xattrs` if asked."""
        return self._request("stat", [*self._file_fields(path, user, None), ("follow", follow), ("xattrs", xattrs)])

    def list(self, path: str, *, depth: int = 1, user: str | None = None, xattrs: bool = False) -> list[dict[str, str]]:
        with self.connection(self.deadlines.answer + 5) as st:
            st.send(encode("list", [*self._file_fields(path, user, None), ("depth", depth), ("xattrs", xattrs)]))
            return [parse_fields(p) for t, p in st.frames() if t == "I"]

    def mkdir(self, path: str, *, user: str | None = None) -> None:
        self._request("mkdir", self._file_fields(path, user, None))

    def move(self, src: str, dst: str, *, user: str | None = None) -> None:
        self._file_fields(dst, user, None)
        self._request("move", [*self._file_fields(src, user, None), ("to", dst)])

    def remove(self, path: str, *, user: str | None = None, timeout: float | None = None) -> None:
        self._request("remove", self._file_fields(path, user, timeout), timeout=(timeout or self.deadlines.answer) + 5)

