"""Watching a directory inside a sandbox: the agent's `watch` (inotify, docs/sandbox-agent.md)
streamed by a reader thread into a bounded queue that `get_new_events` drains.

A sandbox that floods events cannot grow host memory without bound: past `max_events` queued, new
events are dropped and counted (`dropped`); the agent's own inotify queue overflowing is counted in
`overflows`. A checkpoint cuts the watch's connection at once (it never ends by itself, so waiting
for it would only delay the dump; a connection to the host cannot be inside at a dump): the reader
watches again once the sandbox reopens (after the thaw, a resume from hibernation). Changes made
between the cut and the new watch being in place (the few milliseconds before the freeze and after
the thaw; none while frozen or hibernated) are not reported: each such gap is counted in `gaps`,
incremented when the watch is whole again. Killing the sandbox ends the watch.

Each watch is an inotify instance of the sandbox's root inside it, which the kernel charges to the
sandbox's user namespace and to host root (runtime/drivers/inotify.py): a sandbox has at most
`MAX_WATCHES` open at once (`WatchBudget`); past it, and past the kernel's limits inside, a watch is
refused with `SandboxLimitError` naming the limit.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import deque
from collections.abc import Callable

from k3sys.sandbox.errors import AgentInterruptedError, SandboxError, SandboxLimitError
from k3sys.sandbox.runtime.agent import Agent
from k3sys.sandbox.runtime.agent_protocol import encode, parse_fields
from k3sys.sandbox.types import FilesystemEvent

MAX_EVENTS = 100_000  # queued events per watch (about 200 bytes each)
MAX_WATCHES = 32  # watches open at once per sandbox, whoever asks (embedded, service, fleet)


class WatchBudget:
    """The watches each sandbox has open, at most `per_sandbox`."""

    def __init__(self, per_sandbox: int = MAX_WATCHES) -> None:
        self.per_sandbox = per_sandbox
        self._mu = threading.Lock()
        self._open: dict[str, int] = {}

    def take(self, sid: str) -> None:
        """Count one more watch of `sid`; SandboxLimitError if it has `per_sandbox` open."""
        with self._mu:
            n = self._open.get(sid, 0)
            if n >= self.per_sandbox:
                raise SandboxLimitError(f"sandbox {sid} has {n} watches open: its budget of API watches is "
                                        f"{self.per_sandbox} (watch.MAX_WATCHES); stop one first")
            self._open[sid] = n + 1

    def give(self, sid: str) -> None:
        """One watch of `sid` ended."""
        with self._mu:
            n = self._open.pop(sid, 1) - 1
            if n > 0:
                self._open[sid] = n

    def open(self, sid: str) -> int:
        """Watches of `sid` open now."""
        with self._mu:
            return self._open.get(sid, 0)


class WatchHandle:
    """Changes under one directory of a sandbox (see the module docstring); `stop()` ends it."""

    def __init__(self, agent: Agent, path: str, recursive: bool, max_events: int = MAX_EVENTS,
                 ready_timeout: float = 30.0, on_end: Callable[[], None] | None = None) -> None:
        """`on_end`: called once the watch has ended (stopped, or failed), from its reader thread."""
        self.path, self.recursive = path, recursive
        self._on_end = on_end
        self.dropped = 0  # events lost because the queue was full
        self.overflows = 0  # times the sandbox's inotify queue overflowed (events lost inside)
        self.gaps = 0  # times the watch was set up again after a checkpoint cut it (see above)
        self._agent, self._max = agent, max_events
        self._events: deque[FilesystemEvent] = deque()
        self._mu = threading.Lock()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._sock: socket.socket | None = None
        self._error: SandboxError | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch {path}", daemon=True)
        self._thread.start()
        if not self._ready.wait(ready_timeout):
            self.stop()
            raise AgentInterruptedError(f"watch {path}: not in place within {ready_timeout} s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            self._follow()
        finally:
            if self._on_end is not None:
                self._on_end()

    def _follow(self) -> None:
        while not self._stopped.is_set():
            try:
                with self._agent.connection(None, stream=True) as st:
                    with self._mu:
                        self._sock = st.sock
                    if self._stopped.is_set():
                        return
                    st.send(encode("watch", [("path", self.path), ("recursive", self.recursive), ("timeout", 0)]))
                    for _, payload in st.frames():
                        self._take(parse_fields(payload))
                return  # the agent ended the stream without an error: nothing more will come
            except AgentInterruptedError:
                continue  # cut by a checkpoint: watch again once the sandbox reopens
            except SandboxError as e:
                if not self._stopped.is_set():
                    self._error = e
                self._ready.set()
                return
            finally:
                with self._mu:
                    self._sock = None

    def _take(self, f: dict[str, str]) -> None:
        if "ready" in f:
            with self._mu:
                self.gaps += self._ready.is_set()  # ready again: a checkpoint's gap ends here
            self._ready.set()
            return
        with self._mu:
            if f.get("type") == "overflow":
                self.overflows += 1
            elif len(self._events) >= self._max:
                self.dropped += 1
            else:
                self._events.append(FilesystemEvent(f["type"], f["path"], f.get("dir") == "1"))

    def get_new_events(self) -> list[FilesystemEvent]:
        """The events since the last call, oldest first. Raises the error that ended the watch (the
        sandbox was killed, the directory is not there) once its events are drained."""
        with self._mu:
            out = list(self._events)
            self._events.clear()
        if not out and self._error is not None:
            raise self._error
        return out

    def stop(self) -> None:
        """End the watch (the agent's watcher goes with the connection)."""
        self._stopped.set()
        with self._mu:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)

    def __enter__(self) -> WatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
