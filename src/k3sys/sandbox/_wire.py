"""The sandbox service's wire format, shared by server and client: JSON shapes and the error mapping.

Every failure has one body shape, `{"error": {"type": <SandboxError.code>, "message": ...}}` (a
command timeout adds `stdout` and `stderr`); its type is repeated in the `k3sys-error-type` header,
and for HEAD requests (answered without a body) the message in `k3sys-error-message`, URL-quoted.
`status_of` (server: exception -> status) and `error_of` (client: status + body -> the exception the
embedded SDK raises) are the only places that choose or read a status code:

    404 not_found, checkpoint_not_found, file_not_found      409 invalid_state, checkpoint_exists
    422 invalid_argument, unknown_template, path_escape,      413 too_large
        store_input                                           408 command_timeout
    401 unauthorized                                          429 capacity
    503 unavailable, runtime_locked                           500 everything else
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from k3sys.sandbox.errors import (
    AuthError,
    CapacityError,
    CheckpointExistsError,
    CommandTimeoutError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    RuntimeLockedError,
    SandboxError,
    SandboxFileNotFoundError,
    StoreInputError,
    TooLargeError,
    UnavailableError,
    error_from_code,
)
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, EntryInfo, SandboxInfo

ERROR_HEADER = "k3sys-error-type"
ERROR_MESSAGE_HEADER = "k3sys-error-message"

# Most specific class first is not needed: `status_of` walks the exception's MRO.
_STATUS: dict[type[SandboxError], int] = {
    NotFoundError: 404,
    SandboxFileNotFoundError: 404,
    InvalidStateError: 409,
    CheckpointExistsError: 409,
    InvalidArgumentError: 422,
    StoreInputError: 422,
    TooLargeError: 413,
    CommandTimeoutError: 408,
    AuthError: 401,
    CapacityError: 429,
    UnavailableError: 503,
    RuntimeLockedError: 503,
}
# What a status means when the body is not ours (a proxy's page, a bodiless HEAD answer).
_BY_STATUS: dict[int, type[SandboxError]] = {
    404: NotFoundError, 409: InvalidStateError, 422: InvalidArgumentError, 400: InvalidArgumentError,
    413: TooLargeError, 408: CommandTimeoutError, 401: AuthError, 403: AuthError, 429: CapacityError,
    502: UnavailableError, 503: UnavailableError, 504: UnavailableError,
}


def status_of(exc: BaseException) -> int:
    """The HTTP status for an exception (500 for anything not in the table, including non-sandbox errors)."""
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


def error_body(exc: BaseException) -> dict[str, Any]:
    """The one error body shape; anything that is not a `SandboxError` is reported as `internal`."""
    if isinstance(exc, SandboxError):
        err: dict[str, Any] = {"type": exc.code, "message": str(exc)}
        if isinstance(exc, CommandTimeoutError):
            err |= {"stdout": exc.stdout, "stderr": exc.stderr}
    else:
        err = {"type": "internal", "message": f"{type(exc).__name__}: {exc}"}
    return {"error": err}


def error_of(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> SandboxError:
    """The exception an error answer stands for: by its `type` when the body (or header) has one,
    else by its status; the message is the server's."""
    err: dict[str, Any] = {}
    try:
        parsed = json.loads(body) if body else {}
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            err = parsed["error"]
    except ValueError:
        pass
    headers = headers or {}
    code = err.get("type") or headers.get(ERROR_HEADER)
    message = str(err.get("message") or unquote(headers.get(ERROR_MESSAGE_HEADER, ""))
                  or f"HTTP {status}: {body[:300].decode(errors='replace')}")
    exc = error_from_code(code, message) if isinstance(code, str) else SandboxError(message)
    if type(exc) is SandboxError and code != SandboxError.code:  # a type this client does not know
        exc = _BY_STATUS.get(status, SandboxError)(message)
    if isinstance(exc, CommandTimeoutError):
        exc.stdout, exc.stderr = str(err.get("stdout", "")), str(err.get("stderr", ""))
    return exc


def error_type_for_status(status: int) -> str:
    """The error type of a bare HTTP status (unknown route, wrong method, ...)."""
    cls = _BY_STATUS.get(status)
    return cls.code if cls is not None else f"http_{status}"


# --- JSON shapes -----------------------------------------------------------------------------------


def sandbox_info(d: Mapping[str, Any]) -> SandboxInfo:
    return SandboxInfo(**{**d, "spec": SandboxSpec.from_json(d["spec"])})


def checkpoint_info(d: Mapping[str, Any]) -> CheckpointInfo:
    return CheckpointInfo(**d)


def entry_info(d: Mapping[str, Any]) -> EntryInfo:
    return EntryInfo(**d)


def command_result(d: Mapping[str, Any]) -> CommandResult:
    return CommandResult(**d)
