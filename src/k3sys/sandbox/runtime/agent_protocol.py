"""The wire format of `k3sys-agent` (docs/sandbox-agent.md), host side: frames, field lists, the
agent's errors as our exceptions, and what its answers are made of (`Exit`, `Gap`, `Output`).

A frame is a 4-byte big-endian length, a type byte and the payload; one request per connection: a
`Q` frame (operation and `key=value` fields), data frames for writes, then the agent's frames up to
one final `R` (result) or `X` (error).
"""

from __future__ import annotations

import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from k3sys.sandbox.errors import (
    AgentError,
    CommandTimeoutError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxLimitError,
    WrongFileTypeError,
)

T = TypeVar("T")
FRAME_MAX = 1 << 20
CHUNK = 1 << 16
_HEAD = struct.Struct(">I")

# The agent's errno names -> our exception classes (anything else: AgentError).
_ERRORS: dict[str, type[SandboxError]] = {
    "ENOENT": SandboxFileNotFoundError, "ENOTDIR": WrongFileTypeError, "EISDIR": WrongFileTypeError,
    "EPERM": PermissionDeniedError, "EACCES": PermissionDeniedError, "EROFS": PermissionDeniedError,
    "EINVAL": InvalidArgumentError, "ENAMETOOLONG": InvalidArgumentError, "ELOOP": InvalidArgumentError,
    "EEXIST": InvalidArgumentError, "ENOTEMPTY": InvalidArgumentError, "EXDEV": InvalidArgumentError,
    "ESRCH": NotFoundError, "ETIMEDOUT": CommandTimeoutError, "E2BIG": InvalidArgumentError,
    # A limit of the sandbox's own ran out: its descriptors or a user's inotify instances (EMFILE),
    # its disk or a user's inotify watches (ENOSPC); the agent's message names which.
    "EMFILE": SandboxLimitError, "ENOSPC": SandboxLimitError,
}

# User extended attributes (agent/xattr.c has the same bounds): at most XATTR_COUNT_MAX per file,
# names (with their `user.` prefix) up to XATTR_NAME_LEN_MAX bytes, values up to XATTR_VALUE_LEN_MAX.
XATTR_COUNT_MAX = 32
XATTR_NAME_LEN_MAX = 255
XATTR_VALUE_LEN_MAX = 4096
_XATTR = "xattr."


@dataclass(frozen=True)
class Exit:
    """How a process ended: `exit` (128 + signal when killed by one), `signal` (0 if none), bytes
    of its output the ring `dropped`, and `end`, the offset just past its last output byte."""

    exit: int
    signal: int
    dropped: int
    end: int


@dataclass(frozen=True)
class Gap:
    """`n` bytes of output the ring dropped before the reader got to them."""

    n: int


@dataclass
class Output:
    """Output of a process as (stream, bytes) pieces in write order, `stream` "stdout" / "stderr",
    keeping at most `cap` bytes (the newest; None: all); what falls out is counted in `dropped`."""

    cap: int | None = 16 << 20
    dropped: int = 0

    def __post_init__(self) -> None:
        self.pieces: deque[tuple[str, bytes]] = deque()
        self.size = 0

    def add(self, stream: str, data: bytes) -> None:
        self.pieces.append((stream, data))
        self.size += len(data)
        while self.cap is not None and self.size > self.cap:
            s, d = self.pieces.popleft()
            cut = min(len(d), self.size - self.cap)
            if cut < len(d):
                self.pieces.appendleft((s, d[cut:]))
            self.size -= cut
            self.dropped += cut

    def text(self, stream: str) -> bytes:
        return b"".join(d for s, d in self.pieces if s == stream)


def parse_fields(payload: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in payload.split(b"\0"):
        if f:
            k, _, v = f.decode("utf-8", "surrogateescape").partition("=")
            out.setdefault(k, v)
    return out


def xattr_fields(xattrs: dict[str, bytes] | None) -> list[tuple[str, object]]:
    """`xattrs` checked and as request fields (`xattr.<hex name>=<hex value>`): names `user.<x>`
    without NUL, within the bounds above; InvalidArgumentError names the offending one."""
    if not xattrs:
        return []
    if not isinstance(xattrs, dict) or len(xattrs) > XATTR_COUNT_MAX:
        raise InvalidArgumentError(f"xattrs: expected a dict of at most {XATTR_COUNT_MAX}, got {xattrs!r:.200}")
    out: list[tuple[str, object]] = []
    for name, value in xattrs.items():
        raw = name.encode("utf-8", "surrogateescape") if isinstance(name, str) else b""
        if not raw.startswith(b"user.") or len(raw) == 5 or len(raw) > XATTR_NAME_LEN_MAX or b"\0" in raw:
            raise InvalidArgumentError(f"xattrs: expected a name user.<x> of at most {XATTR_NAME_LEN_MAX} bytes "
                                       f"without NUL, got {name!r:.300}")
        if not isinstance(value, bytes) or len(value) > XATTR_VALUE_LEN_MAX:
            raise InvalidArgumentError(f"xattrs[{name!r}]: expected at most {XATTR_VALUE_LEN_MAX} bytes, "
                                       f"got {value!r:.100}")
        out.append((_XATTR + raw.hex(), value.hex()))
    return out


def xattrs_of(f: dict[str, str]) -> tuple[tuple[str, bytes], ...]:
    """The user.* xattrs an entry's fields carry, sorted by name."""
    return tuple(sorted((bytes.fromhex(k[len(_XATTR):]).decode("utf-8", "surrogateescape"), bytes.fromhex(v))
                        for k, v in f.items() if k.startswith(_XATTR)))


def encode(op: str, fields: Iterable[tuple[str, object]]) -> bytes:
    parts = [op.encode()]
    for k, v in fields:
        if v is None:
            continue
        b = (str(int(v)) if isinstance(v, bool) else str(v)).encode("utf-8", "surrogateescape")
        if b"\0" in b:
            raise InvalidArgumentError(f"{k}: NUL bytes are not allowed, got {v!r}")
        parts.append(k.encode() + b"=" + b)
    body = b"\0".join(parts) + b"\0"
    if len(body) + 1 > FRAME_MAX:
        raise InvalidArgumentError(f"request too large: {len(body)} bytes (at most {FRAME_MAX - 1})")
    return _HEAD.pack(len(body) + 1) + b"Q" + body


def agent_error(f: dict[str, str]) -> SandboxError:
    cls = _ERRORS.get(f.get("code", ""), AgentError)
    return cls(f"sandbox agent: {f.get('msg', 'failed')} ({f.get('code', '?')})")


class Stream:
    """One request's connection: send frames, read them back. `deadline` (time.monotonic()): when the
    whole request must be done (past it: TimeoutError); with `probe`, a wait with nothing sent or
    received for `silence` seconds calls `probe()`, which raises if the agent is stuck, and goes on."""

    def __init__(self, sock: socket.socket, deadline: float | None, silence: float = 0.0,
                 probe: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.deadline = deadline
        self.silence = silence
        self.probe = probe
        self.refused = False

    def _io(self, op: Callable[[], T]) -> T:
        """`op()`, one send or receive on the socket, within the deadline and probing on silence."""
        while True:
            left = None if self.deadline is None else max(0.001, self.deadline - time.monotonic())
            probing = self.probe is not None and (left is None or left > self.silence)
            self.sock.settimeout(self.silence if probing else left)
            try:
                return op()
            except TimeoutError:
                if not probing:
                    raise
                self.probe()  # type: ignore[misc]

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # not sendall: a send cut by a probe must not lose what went out
            view = view[self._io(partial(self.sock.send, view)):]

    def data(self, chunk: bytes) -> None:
        for i in range(0, len(chunk), CHUNK):
            piece = chunk[i:i + CHUNK]
            self._send_data(_HEAD.pack(len(piece) + 1) + b"D" + piece)

    def end(self) -> None:
        self._send_data(_HEAD.pack(1) + b"Z")

    def _send_data(self, frame: bytes) -> None:
        # An agent that refused the request (a path it cannot write) answers and closes without
        # reading the data: stop sending, and let the reply, read next, say why.
        if not self.refused:
            try:
                self.send(frame)
            except (BrokenPipeError, ConnectionResetError):
                self.refused = True

    def _exact(self, n: int) -> bytes:
        b = b""
        while len(b) < n:  # MSG_WAITALL returns short at the end, on a signal or a timeout
            more = self._io(partial(self.sock.recv, n - len(b), socket.MSG_WAITALL))
            if not more:
                raise EOFError
            b += more
        return b

    def frame(self) -> tuple[str, bytes]:
        (n,) = _HEAD.unpack(self._exact(4))
        if not 1 <= n <= FRAME_MAX:
            raise AgentError(f"sandbox agent: bad frame length {n}")
        body = self._exact(n)
        return chr(body[0]), body[1:]

    def frames(self) -> Iterator[tuple[str, bytes]]:
        """Frames up to the final one; an X frame raises, an R frame's fields are the last yield."""
        while True:
            t, payload = self.frame()
            if t == "X":
                raise agent_error(parse_fields(payload))
            yield t, payload
            if t == "R":
                return

    def result(self) -> dict[str, str]:
        last = b""
        for t, payload in self.frames():
            last = payload if t == "R" else last
        return parse_fields(last)
