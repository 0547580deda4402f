"""Sockets made inside a sandbox's network namespace by the host: the port proxy's way in
(docs/sandbox_service.md, "Ports").

A socket belongs to the network namespace it was created in, whatever thread later uses it. So one
thread of ours (`NetnsSockets`) enters the sandbox's namespace with setns(2), creates the socket and
goes back; the service connects and reads it from its event loop like any other socket. Why not
have the agent connect inside and pass the descriptor over its unix socket: the host's way needs no
agent round trip, works while the agent is busy or replaced by a user's image's own init, and
costs two system calls; setns needs CAP_SYS_ADMIN, which the service already has (it runs runc).

The namespace is named by the sandbox's PID 1, which the runtime knows (runc's state: host pid and
start time); nothing the sandbox controls is followed. Race-free: a pidfd is opened on the pid,
then the process's start time (procfs, field 22) is checked against runc's record while the pidfd
holds the process, so a PID 1 that died and whose pid was reused is refused, not entered; setns on
the pidfd then enters exactly that process's namespace (Linux >= 5.8).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from k3sys.sandbox.errors import DriverError


class Gate(Protocol):
    """What `NetnsSockets.open` needs of a sandbox's agent link (agent_link.AgentLink)."""

    who: str

    def wait_open(self) -> None: ...

    def adopt_socket(self, s: socket.socket, peer: int) -> bool: ...

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class _SockaddrUnspec(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_char * 14)]


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def open_process(pid: int, start_ticks: int) -> int:
    """A pidfd of host process `pid`, if it is the one that started at `start_ticks` (clock ticks
    after boot, as runc records its PID 1); DriverError if it is gone or another process."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise DriverError(f"process {pid} is gone") from None
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        # The name (field 2) may hold spaces and parentheses: fields after its last ')' are fixed.
        start = int(stat[stat.rindex(b")") + 2:].split()[19])
        signal.pidfd_send_signal(fd, 0)  # alive after the read: the stat was this process's
    except (OSError, ValueError, IndexError) as e:
        os.close(fd)
        raise DriverError(f"process {pid} is gone ({e})") from None
    if start != start_ticks:
        os.close(fd)
        raise DriverError(f"process {pid} is not the sandbox's PID 1 (started at {start}, not {start_ticks})")
    return fd


class NetnsSockets:
    """Creates sockets in other processes' network namespaces, on one thread of its own (so no
    other work ever runs in a sandbox's namespace, even if going back failed)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="k3sys-netns")
        self._home: int | None = None  # the thread's own namespace, opened on it
        self._mu = threading.Lock()

    def socket(self, pidfd: int, family: socket.AddressFamily) -> socket.socket:
        """A non-blocking TCP socket of `family` in the network namespace of the process `pidfd`."""
        return self._pool.submit(self._make, pidfd, family).result()

    def open(self, link: Gate, init: Callable[[], tuple[int, int] | None],
             family: socket.AddressFamily) -> socket.socket:
        """A socket in the namespace of the sandbox whose agent is `link` and whose PID 1 `init()`
        names (host pid, start ticks), adopted by `link` (its gate resets it; `link.release_socket` it).
        Waits while the gate is closed (a checkpoint), as agent calls do."""
        while True:
            link.wait_open()
            ident = init()
            if ident is None:
                raise DriverError(f"{link.who}: the sandbox has no PID 1")
            pidfd = open_process(*ident)
            try:
                s = self.socket(pidfd, family)
            finally:
                os.close(pidfd)
            if link.adopt_socket(s, ident[0]):
                return s
            s.close()  # the gate closed meanwhile (a restore may bring a new namespace): again

    def _make(self, pidfd: int, family: socket.AddressFamily) -> socket.socket:
        if self._home is None:
            self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(pidfd)
        except OSError as e:
            raise DriverError(f"cannot enter the sandbox's network namespace: {e.strerror}") from None
        try:
            s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        finally:
            _setns(self._home)  # a failure here leaves only this thread astray: every use enters first
        return s

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._mu, contextlib.suppress(OSError):
            if self._home is not None:
                os.close(self._home)
                self._home = None


def reset(s: socket.socket) -> None:
    """Abort TCP connection `s` with a RST, keeping its descriptor valid for its owner (a connect to
    AF_UNSPEC is tcp_disconnect): the peer inside the sandbox goes straight to CLOSED, so a CRIU dump
    right after finds no connection to the host (and the host none in TIME_WAIT)."""
    fd = s.fileno()
    if fd >= 0:
        addr = _SockaddrUnspec(socket.AF_UNSPEC)
        _libc.connect(fd, ctypes.byref(addr), ctypes.sizeof(addr))
