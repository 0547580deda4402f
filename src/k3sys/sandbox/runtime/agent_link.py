"""The host's connection to one sandbox's agent (its PID 1): the socket, the deadlines every call
carries, and the gate the life cycle needs. `Agent` (agent.py) adds the requests on top.

The host never resolves a path inside the sandbox: it opens the socket's directory without
following a symlink and checks the peer's pid (SO_PEERCRED) is the sandbox's PID 1, so a socket
the sandbox swapped for a link to some host socket is refused.

Deadlines (`Deadlines`, the one place they are set): no call waits on an agent that stopped
answering. Connecting and a request's answer are bounded; a call that waits on the sandbox (a
command's output, a wait, a watch) may stay silent for as long as the sandbox is (a command that
prints nothing for an hour), so after a silence the agent is pinged beside it, and only a ping
left unanswered ends the call. Either way it fails with `AgentTimeoutError` naming the sandbox.

The gate: `close_gate` (before a CRIU dump: a connection to the host is a resource CRIU cannot
save) lets calls in flight finish for a grace period and cuts the rest with
`AgentInterruptedError` (retryable: the sandbox lost nothing); `quiesce` has the agent drop their
sockets; new calls wait until `open_gate` (after the thaw or restore). `cut` ends every call for
good (a kill), the quiesce of a dump included. The same gate holds the host's TCP connections into
the sandbox's network (the port proxy's, `adopt_socket`): it resets them (a RST, so neither end lingers
and CRIU finds no connection to the host), and new ones wait for it as calls do.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from k3sys.sandbox.errors import (
    AgentError,
    AgentInterruptedError,
    AgentTimeoutError,
    CommandTimeoutError,
    InvalidArgumentError,
    SandboxError,
)
from k3sys.sandbox.runtime import netns
from k3sys.sandbox.runtime.agent_protocol import Stream, encode

SOCKET = ".k3sys/agent.sock"  # relative to the sandbox's root
ANSWER_ENV = "K3SYS_AGENT_ANSWER_S"  # overrides `Deadlines.answer` (and the probe, half of it)
_CONNECT_SLICE = 0.1  # s: how often a connect waiting on a full backlog looks whether it was cut


@dataclass(frozen=True)
class Deadlines:
    """How long the host waits on a sandbox's agent, in seconds.

    `answer`: a connection, and the whole answer to a request that does not wait on the sandbox
    (ping, signal, start, stat, list, quiesce, ...). The agent answers those from its event loop (file
    work runs in forked workers with their own timeouts), in well under a millisecond; 30 s leaves
    room for a host at load 15, a sandbox thrashing at its memory limit or throttled at its CPU
    quota, and an agent faulting its pages in after a lazy restore.
    `probe`: silence after which a call that waits on the sandbox pings the agent (bounded by
    `answer`); a frozen sandbox counts as answering. So a stuck agent fails such a call within
    `probe + answer`, and a silent command never does.
    """

    answer: float = 30.0
    probe: float = 15.0

    def __post_init__(self) -> None:
        for name in ("answer", "probe"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 3600:
                raise InvalidArgumentError(f"agent deadline {name}: expected 0 < s <= 3600, got {v!r}")

    @classmethod
    def default(cls) -> Deadlines:
        """The defaults, or `K3SYS_AGENT_ANSWER_S` (with a probe of half of it) where set."""
        env = os.environ.get(ANSWER_ENV)
        if not env:
            return cls()
        try:
            answer = float(env)
        except ValueError:
            raise InvalidArgumentError(f"{ANSWER_ENV}: expected seconds, got {env!r}") from None
        return cls(answer, answer / 2)


class AgentLink:
    """Connections to the agent at `root/.k3sys/agent.sock`, of sandbox `sandbox` (named in errors);
    `pid()` gives the host pid the socket's peer must have (None: not checked, for an agent run by
    hand); `frozen()` whether the sandbox is frozen now (its agent cannot answer, by design)."""

    def __init__(self, root: Path, pid: Callable[[], int | None] = lambda: None, *, sandbox: str = "",
                 deadlines: Deadlines | None = None, frozen: Callable[[], bool] = lambda: False) -> None:
        self.root = root
        self.who = f"sandbox {sandbox}'s agent" if sandbox else f"the agent at {root}"
        self.deadlines = deadlines or Deadlines.default()
        self._pid = pid
        self._frozen = frozen
        self._cv = threading.Condition()
        self._open = True
        self._dead = ""  # why calls fail for good (the sandbox was killed)
        self._peer: int | None = None  # the PID 1 checked last (cached until the gate reopens)
        self._live: set[socket.socket] = set()
        # Of those, the calls that wait on the sandbox (an output follower, a wait, a watch): they
        # may never end by themselves, so a checkpoint cuts them at once (they reconnect).
        self._streams: set[socket.socket] = set()
        self._tcp: set[socket.socket] = set()  # host connections into the sandbox's network (`adopt_socket`)

    def stuck(self, seconds: float, what: str = "") -> AgentTimeoutError:
        """The error of a call the agent left unanswered for `seconds`."""
        return AgentTimeoutError(f"{self.who} did not answer{what} within {seconds:g} s: it is stopped or "
                                 "overloaded (kill the sandbox, or retry)")

    def _connect(self) -> socket.socket:
        try:
            d = os.open(self.root, os.O_PATH | os.O_DIRECTORY)
        except OSError as e:
            raise AgentError(f"{self.who} is unreachable: no sandbox root at {self.root} ({e.strerror})") from None
        try:
            sub, name = os.path.split(SOCKET)
            # No symlink followed inside the sandbox: the directory by O_NOFOLLOW, the socket
            # itself by the peer check below (a link to another socket has another peer).
            sd = os.open(sub, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=d)
        except OSError as e:
            raise AgentError(f"{self.who} is unreachable: no socket directory under {self.root} ({e.strerror}); "
                             "commands.run falls back to `runc exec`, other calls need the agent") from None
        finally:
            os.close(d)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._connect_within(s, f"/proc/self/fd/{sd}/{name}")
            peer = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            want = self._peer
            if want != peer:  # not the PID 1 checked last: ask again (reading runc's state costs)
                want = self._pid()
            if want is not None:
                if peer != want:
                    raise AgentError(f"{self.who}: the socket's peer is pid {peer}, not the sandbox's PID 1 ({want})")
                self._peer = peer
        except OSError as e:
            s.close()
            raise AgentError(f"{self.who} is unreachable ({e.strerror or e}): it may have died; "
                             "commands.run falls back to `runc exec`, other calls need the agent") from None
        except BaseException:
            s.close()
            raise
        finally:
            os.close(sd)
        return s

    def _connect_within(self, s: socket.socket, path: str) -> None:
        """Connect `s` to `path` within `Deadlines.answer`. A connect waits while the agent's backlog
        is full (an agent that accepts nothing any more); it wakes as soon as there is room, and at
        least every `_CONNECT_SLICE` s (SO_SNDTIMEO, cleared after) to see whether a `cut` ended it."""
        deadline = time.monotonic() + self.deadlines.answer
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(_CONNECT_SLICE))
        while True:
            try:
                s.connect(path)
                break
            except BlockingIOError:
                if self._dead:
                    raise AgentError(f"{self.who}: {self._dead}") from None
                if time.monotonic() >= deadline:
                    raise self.stuck(self.deadlines.answer, " (its socket's backlog stayed full)") from None
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0))

    def _enlist(self, s: socket.socket, stream: bool = False) -> None:
        """Register call `s` (so `close_gate` and `cut` reach it); one made after a `cut` is refused."""
        with self._cv:
            if self._dead:
                s.close()
                raise AgentError(f"{self.who}: {self._dead}")
            self._live.add(s)
            if stream:
                self._streams.add(s)

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None, stream: bool = False, command: bool = False,
              probe: bool = True) -> Iterator[Stream]:
        """A connection for one request, registered so `close_gate` can cut it; waits while the gate
        is closed (a checkpoint in progress). `timeout` (s): for the whole call (None: none; a
        silent one is probed, see `Deadlines`); past it, CommandTimeoutError if it is a `command`'s
        own timeout, else AgentTimeoutError. `stream`: it waits on the sandbox (see `_streams`)."""
        self.wait_open()
        s = self._connect()
        self._enlist(s, stream)
        try:
            yield Stream(s, None if timeout is None else time.monotonic() + timeout, self.deadlines.probe,
                         self._probe if probe else None)
        except SandboxError:
            raise
        except (EOFError, OSError) as e:
            with self._cv:
                cut = not self._open
            if cut and self._dead:
                raise AgentError(f"{self.who}: {self._dead}") from None
            if cut:
                raise AgentInterruptedError(f"{self.who}: call cut by a checkpoint of the sandbox; retry") from None
            if isinstance(e, TimeoutError):
                if command:
                    raise CommandTimeoutError(f"{self.who}: no answer within {timeout:g} s") from None
                raise self.stuck(timeout or self.deadlines.answer) from None
            raise AgentError(f"{self.who}: the connection broke ({e or 'closed'}); the agent may be dead") from None
        finally:
            with self._cv:
                self._live.discard(s)
                self._streams.discard(s)
                self._cv.notify_all()
            s.close()

    def _probe(self) -> None:
        """Raise AgentTimeoutError unless the agent answers a ping. A frozen sandbox (paused), and one
        whose gate is closed (a checkpoint, which cuts its calls itself), count as answering."""
        with self._cv:
            if not self._open:
                return
        if self._frozen():
            return
        try:
            with self.connection(self.deadlines.answer, probe=False) as st:
                st.send(encode("ping", ()))
                st.result()
        except AgentTimeoutError:
            if not self._frozen():  # frozen meanwhile: a pause, not a stuck agent
                raise

    def mark_streaming(self, s: socket.socket) -> None:
        """Call `s` now waits on the sandbox (a `run` whose start went through): cut it at once if a
        checkpoint is waiting for calls to end."""
        with self._cv:
            if s in self._live:
                self._streams.add(s)
                if not self._open:
                    _shutdown({s})
                self._cv.notify_all()

    def wait_open(self) -> None:
        """Wait (up to 60 s) until calls may enter: AgentInterruptedError past it, AgentError once cut."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._open or self._dead, timeout=60):
                raise AgentInterruptedError(f"{self.who}: the sandbox stayed closed to calls for 60 s")
            if self._dead:
                raise AgentError(f"{self.who}: {self._dead}")

    def adopt_socket(self, s: socket.socket, peer: int) -> bool:
        """Register `s`, a TCP socket made in the namespace of PID 1 `peer` (a host pid), so the gate
        resets it; False (not registered) when the gate closed or PID 1 changed since: make it anew.
        Its owner must `release_socket` it before closing it (a reset never reaches a reused descriptor)."""
        with self._cv:
            if not self._open or self._dead or self._pid() != peer:
                return False
            self._tcp.add(s)
            return True

    def release_socket(self, s: socket.socket) -> None:
        """Forget and close an adopted socket."""
        with self._cv:
            self._tcp.discard(s)
            s.close()

    def _reset_tcp(self) -> None:
        for s in self._tcp:
            netns.reset(s)
        self._tcp.clear()  # their owners still close them (release)

    def close_gate(self, grace: float = 0.5) -> bool:
        """Hold new calls and give those in flight `grace` seconds; cut the rest (their callers get
        AgentInterruptedError). Returns whether any was cut: then `quiesce` must run before a dump."""
        with self._cv:
            self._open = False
            self._reset_tcp()
            cut = bool(self._streams)
            _shutdown(self._streams)  # they would only use up the grace: they reconnect
            self._cv.wait_for(lambda: self._live <= self._streams, timeout=grace)
            cut = cut or bool(self._live)
            _shutdown(self._live)
            self._cv.wait_for(lambda: not self._live, timeout=5)
        return cut

    def quiesce(self) -> None:
        """Have the agent drop every connection whose client is gone (so nothing of the host's
        remains in the sandbox for a dump). Bypasses the gate; within `Deadlines.answer`, and ended
        by a `cut` (a kill need not wait for it)."""
        s = self._connect()
        self._enlist(s)
        try:
            st = Stream(s, time.monotonic() + self.deadlines.answer)
            st.send(encode("quiesce", ()))
            st.result()
            # The agent closes its end first, then we ours: no half-open socket left inside.
            s.recv(1)
        except TimeoutError:
            raise self.stuck(self.deadlines.answer, " to a quiesce") from None
        except (EOFError, OSError) as e:
            raise AgentError(f"{self.who}: quiesce failed: {self._dead or e or 'connection closed'}") from None
        finally:
            with self._cv:
                self._live.discard(s)
                self._cv.notify_all()
            s.close()

    def open_gate(self) -> None:
        """Let calls through again (after a thaw or restore; a restore brings a new PID 1)."""
        with self._cv:
            self._peer = None
            self._dead = ""
            self._open = True
            self._cv.notify_all()

    def cut(self, reason: str) -> None:
        """For good: fail calls waiting at the gate and those in flight with `reason`."""
        with self._cv:
            self._dead = reason
            self._open = False
            self._reset_tcp()
            _shutdown(self._live)
            self._cv.notify_all()


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def _shutdown(socks: set[socket.socket]) -> None:
    """Cut calls: their threads see the end of the stream and leave (`connection` closes the sockets)."""
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
