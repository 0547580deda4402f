"""Connect RPC's wire format with the JSON codec (connectrpc.com/docs/protocol), shared by the envd
plane of the service and the k3sys remote client; standard library only.

A unary call is `POST /<package.Service>/<Method>` with an `application/json` body, answered with a
JSON body (or an error: a Connect status, `{"code", "message"}`). A stream's body is a sequence of
frames, each 1 byte of flags then a 4-byte big-endian length then the JSON message; the last frame
has flag 0x02 and holds `{}` or `{"error": {...}, "metadata": {...}}`. Our error type rides along
as the `k3sys-error-type` header (unary) or trailer (streams), so the k3sys client raises the class
the embedded runtime raises; an e2b client sees the Connect code it maps to its exceptions.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

from k3sys.sandbox._wire import ERROR_HEADER as ERROR_TYPE  # our error type: a header, or a stream's trailer
from k3sys.sandbox.errors import (
    AgentTimeoutError,
    AuthError,
    CapacityError,
    CommandTimeoutError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    PermissionDeniedError,
    SandboxError,
    SandboxFileNotFoundError,
    TooLargeError,
    UnavailableError,
    error_from_code,
)

STREAM_CONTENT_TYPE = "application/connect+json"
UNARY_CONTENT_TYPE = "application/json"
END_STREAM = 0x02
MAX_MESSAGE = 16 << 20  # bytes in one frame, at most (a frame's length is the peer's to choose)
_HEAD = struct.Struct(">BI")

# Connect code -> the HTTP status of a unary error answer (the protocol's table).
STATUS = {"canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
          "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
          "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
          "data_loss": 500, "unauthenticated": 401}
# Our error classes -> Connect codes, most specific first; anything else is `internal`.
_CODES: list[tuple[type[SandboxError], str]] = [
    (TooLargeError, "resource_exhausted"), (NotFoundError, "not_found"), (SandboxFileNotFoundError, "not_found"),
    (InvalidArgumentError, "invalid_argument"),
    (InvalidStateError, "failed_precondition"), (AuthError, "unauthenticated"),
    (PermissionDeniedError, "permission_denied"), (CapacityError, "resource_exhausted"),
    (CommandTimeoutError, "deadline_exceeded"), (AgentTimeoutError, "deadline_exceeded"),
    (UnavailableError, "unavailable"),
]
# Connect code -> the class the k3sys client raises when the answer names no type of ours.
_CLASSES = {"not_found": NotFoundError, "invalid_argument": InvalidArgumentError, "out_of_range": InvalidArgumentError,
            "failed_precondition": InvalidStateError, "unauthenticated": AuthError,
            "permission_denied": PermissionDeniedError, "resource_exhausted": CapacityError,
            "deadline_exceeded": CommandTimeoutError, "unavailable": UnavailableError}


class ConnectError(SandboxError):
    """A Connect status to answer with: `code` is a Connect code, `type` our error type if any."""

    def __init__(self, connect_code: str, message: str, type: str | None = None) -> None:
        super().__init__(message)
        self.connect_code, self.type = connect_code, type


def connect_code(exc: BaseException) -> str:
    """The Connect code an exception answers with."""
    if isinstance(exc, ConnectError):
        return exc.connect_code
    return next((c for cls, c in _CODES if isinstance(exc, cls)), "internal")


def error_json(exc: BaseException) -> tuple[dict[str, Any], str | None]:
    """`({"code", "message"}, our error type or None)` for an exception."""
    kind = exc.type if isinstance(exc, ConnectError) else exc.code if isinstance(exc, SandboxError) else None
    message = str(exc) if isinstance(exc, SandboxError) else f"{type(exc).__name__}: {exc}"
    return {"code": connect_code(exc), "message": message}, kind


def frame(message: dict[str, Any], flags: int = 0) -> bytes:
    """One enveloped message."""
    data = json.dumps(message, separators=(",", ":")).encode()
    return _HEAD.pack(flags, len(data)) + data


def end_frame(exc: BaseException | None = None) -> bytes:
    """The end-of-stream frame: `{}`, or the error (and our type as a trailer) the call failed with."""
    if exc is None:
        return frame({}, END_STREAM)
    err, kind = error_json(exc)
    return frame({"error": err, **({"metadata": {ERROR_TYPE: [kind]}} if kind else {})}, END_STREAM)


class FrameReader:
    """Frames out of a byte stream fed in pieces; a frame longer than `limit` is refused."""

    def __init__(self, limit: int = MAX_MESSAGE) -> None:
        self._buf = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
        """`(flags, message)` for every frame completed by `data`."""
        self._buf += data
        while len(self._buf) >= _HEAD.size:
            flags, n = _HEAD.unpack_from(self._buf)
            if n > self._limit:
                raise TooLargeError(f"connect frame of {n} bytes: at most {self._limit}")
            if len(self._buf) < _HEAD.size + n:
                return
            payload = bytes(self._buf[_HEAD.size:_HEAD.size + n])
            del self._buf[:_HEAD.size + n]
            yield flags, decode(payload)

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held (nonzero at the body's end: it was cut short)."""
        return len(self._buf)


def decode(payload: bytes) -> dict[str, Any]:
    """A JSON message; anything but an object is InvalidArgumentError."""
    try:
        msg = json.loads(payload) if payload else {}
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested past Python's stack
        raise InvalidArgumentError(f"connect message: not JSON ({e}): {payload[:80]!r}") from None
    if not isinstance(msg, dict):
        raise InvalidArgumentError(f"connect message: expected a JSON object, got {payload[:80]!r}")
    return msg


def error_of(err: Any, kind: str | None = None) -> SandboxError:
    """The exception a Connect error (`{"code", "message"}`) stands for: our type when the answer
    names one, else the class of its Connect code."""
    err = err if isinstance(err, dict) else {}
    code, message = str(err.get("code", "unknown")), str(err.get("message") or err.get("code") or "connect error")
    if kind:
        exc = error_from_code(kind, message)
        if type(exc) is not SandboxError or kind == SandboxError.code:
            return exc
    return _CLASSES.get(code, SandboxError)(message)


def trailer_type(end: dict[str, Any]) -> str | None:
    """Our error type in an end-of-stream message's metadata, if any."""
    values = (end.get("metadata") or {}).get(ERROR_TYPE) or []
    return str(values[0]) if values else None


def http_error_of(status: int, body: bytes, headers: Any) -> SandboxError:
    """The exception an error answer of envd stands for: a Connect error (`{"code": <name>}`), or one
    of envd's HTTP errors and refusals (`{"code": <status>}`), typed by our header when present."""
    try:
        err = json.loads(body) if body else {}
    except ValueError:
        err = {}
    err = err if isinstance(err, dict) else {}
    kind = headers.get(ERROR_TYPE)
    if not isinstance(err.get("code"), str):
        by_status = {v: k for k, v in STATUS.items() if k not in ("failed_precondition", "aborted", "out_of_range")}
        err = {"code": by_status.get(status, "unknown"),
               "message": err.get("message") or f"HTTP {status}: {body[:300].decode(errors='replace')}"}
    return error_of(err, kind)
