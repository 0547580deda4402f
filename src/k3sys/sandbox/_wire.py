"""The sandbox service's wire format, shared by server and client: JSON shapes and the error mapping.

Every failure has one body shape, `{"error": {"type": <SandboxError.code>, "message": ...}}` (a
command timeout adds `stdout` and `stderr`); its type is repeated in the `k3sys-error-type` header,
and for HEAD requests (answered without a body) the message in `k3sys-error-message`, URL-quoted.
`status_of` (server: exception -> status) and `error_of` (client: status + body -> the exception the
embedded SDK raises) are the only places that read a status code; each error class carries its own
(`SandboxError.http_status`, the table in errors.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from k3sys.sandbox.errors import (
    AuthError,
    CommandTimeoutError,
    InvalidArgumentError,
    SandboxError,
    UnavailableError,
    error_classes,
    error_from_code,
)
from k3sys.sandbox.spec import SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo

ERROR_HEADER = "k3sys-error-type"
ERROR_MESSAGE_HEADER = "k3sys-error-message"

# What a status means when the body is not ours (a proxy's page, a bodiless HEAD answer): the most
# general class that answers with it, and four statuses only proxies and frameworks send.
_BY_STATUS: dict[int, type[SandboxError]] = {
    **{c.http_status: c for c in reversed(error_classes()) if c.http_status != 500},
    400: InvalidArgumentError, 403: AuthError, 502: UnavailableError, 504: UnavailableError,
}


def status_of(exc: BaseException) -> int:
    """The HTTP status for an exception (its class's `http_status`; 500 for anything not a sandbox error)."""
    return exc.http_status if isinstance(exc, SandboxError) else 500


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
