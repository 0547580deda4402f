"""How the SDK reaches a sandbox's port 49999: one HTTP/1.1 request per call, its answer read as
lines with a bound on what the host holds.

- Embedded (a `Runtime` backend): a TCP connection made inside the sandbox's network namespace, so
  it works without `network=True` and costs no process in the sandbox: the runtime's `open_socket`
  (the port proxy's: PID 1 checked through a pidfd, the socket reset by a checkpoint). One connection
  per request, closed at its end: no connection of ours is open between calls, so a checkpoint,
  pause or fork never holds one.
- A sandbox service (`api_url`): the service's port proxy, E2B's header routing (`E2b-Sandbox-Id`,
  `E2b-Sandbox-Port`) on the service's own address.

The server is the sandbox's: every line and the whole answer are bounded here (`LINE_MAX`,
`ANSWER_MAX`) before they are held in host memory.
"""

from __future__ import annotations

import ctypes
import http.client
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from k3sys.sandbox.errors import (
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandboxError,
    TooLargeError,
    UnavailableError,
)

PORT = 49999
LINE_MAX = 64 << 20  # one line of /execute (a large PNG is a few MiB)
ANSWER_MAX = 256 << 20  # all lines of one answer
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _server_error(status: int, body: str) -> SandboxError:
    """The exception of an error status of the server: 404 (no such context) NotFoundError, 400 (a
    bad request, an unsupported language) InvalidArgumentError, the rest SandboxError."""
    cls = {404: NotFoundError, 400: InvalidArgumentError}.get(status, SandboxError)
    return cls(f"code interpreter: {status}: {body}")


class Port:
    """Requests to port `PORT` of sandbox `sid` on backend `rt` (see the module docstring)."""

    def __init__(self, rt: Any, sid: str) -> None:
        self.rt, self.sid = rt, sid
        self.api_url: str | None = getattr(rt, "api_url", None)

    def _open(self, timeout: float | None) -> tuple[http.client.HTTPConnection, Callable[[], None] | None]:
        """A connection for one request, and what releases its socket first (None: nothing)."""
        if self.api_url is not None:
            from urllib.parse import urlsplit

            u = urlsplit(self.api_url)
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            return cls(u.hostname or "127.0.0.1", u.port, timeout=timeout), None
        info = self.rt.info(self.sid)
        if info.state != "running":
            raise InvalidStateError(f"sandbox {self.sid} is {info.state}: connect() (resume) it before running code")
        conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)
        release = None
        try:
            # The runtime's (the port proxy's, runtime/netns.py): made inside the sandbox's network
            # namespace, PID 1 checked through a pidfd, reset by a checkpoint; released, not just closed.
            sock, release = self.rt.open_socket(self.sid)
            sock.settimeout(timeout)
            sock.connect(("127.0.0.1", PORT))
        except BaseException as e:
            if release is not None:
                release()
            if isinstance(e, ConnectionRefusedError):
                raise UnavailableError(f"sandbox {self.sid}: nothing listens on port {PORT} (is it a "
                                       "code-interpreter-v1 sandbox?)") from None
            raise
        conn.sock = sock
        return conn, release

    @contextmanager
    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None
                ) -> Iterator[http.client.HTTPResponse]:
        """Send one request; yields the response (status 2xx; else `_server_error`'s exception)."""
        conn, release = self._open(timeout)
        try:
            headers = {"Content-Type": "application/json", "Connection": "close"}
            if self.api_url is not None:
                headers |= {"E2b-Sandbox-Id": self.sid, "E2b-Sandbox-Port": str(PORT)}
                key = getattr(self.rt, "api_key", None)
                if key:
                    headers["X-API-Key"] = key
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            resp = conn.getresponse()
            if resp.status >= 300:
                raise _server_error(resp.status, resp.read(4096).decode(errors="replace"))
            yield resp
        finally:
            if release is not None:
                release()
            conn.close()

    def call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """A request whose answer is one JSON document (None for an empty one)."""
        with self.request(method, path, body, timeout) as resp:
            data = resp.read(LINE_MAX + 1)
            if len(data) > LINE_MAX:
                raise TooLargeError(f"sandbox {self.sid}: answer to {method} {path} over {LINE_MAX} bytes")
            return json.loads(data) if data.strip() else None


def lines(resp: http.client.HTTPResponse, sid: str) -> Iterator[bytes]:
    """The answer's non-empty lines, each at most LINE_MAX and all together at most ANSWER_MAX bytes."""
    total = 0
    while True:
        line = resp.readline(LINE_MAX + 1)
        if not line:
            return
        total += len(line)
        if len(line) > LINE_MAX or total > ANSWER_MAX:
            raise TooLargeError(f"sandbox {sid}: the code interpreter's answer is over its bound "
                                f"({LINE_MAX} bytes a line, {ANSWER_MAX} in all)")
        if line.strip():
            yield line
