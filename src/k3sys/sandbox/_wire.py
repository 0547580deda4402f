"""The sandbox service's wire format, shared by server and client: JSON shapes and the error mapping.

The service speaks E2B's protocol (docs/sandbox_service.md), so every failure has E2B's body shape,
`{"code": <HTTP status>, "message": ...}`, plus our `type` (<SandboxError.code>; a command timeout
adds `stdout` and `stderr`), from which a k3sys client rebuilds the exception the embedded SDK
raises; the type is repeated in the `k3sys-error-type` header, and for HEAD requests (answered
without a body) the message in `k3sys-error-message`, URL-quoted. `status_of` (server: exception ->
status) and `error_of` (client: status + body -> exception) are the only places that read a status
code; each error class carries its own (`SandboxError.http_status`, the table in errors.py).
JSON keys are camelCase as in E2B's API (`camel` / `snake` convert our dataclasses' fields).
"""

from __future__ import annotations

import dataclasses
import json
import re
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


def error_body(exc: BaseException, status: int | None = None) -> dict[str, Any]:
    """The one error body shape (E2B's `code` and `message`, our `type`); anything that is not a
    `SandboxError` is reported as `internal`. `status`: the HTTP status, by default `status_of(exc)`."""
    code = status or status_of(exc)
    if isinstance(exc, SandboxError):
        err: dict[str, Any] = {"code": code, "message": str(exc), "type": exc.code}
        if isinstance(exc, CommandTimeoutError):
            err |= {"stdout": exc.stdout, "stderr": exc.stderr}
        return err
    return {"code": code, "message": f"{type(exc).__name__}: {exc}", "type": "internal"}


def error_of(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> SandboxError:
    """The exception an error answer stands for: by its `type` when the body (or header) has one,
    else by its status; the message is the server's."""
    err: dict[str, Any] = {}
    try:
        parsed = json.loads(body) if body else {}
        if isinstance(parsed, dict):
            err = parsed
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


def camel(d: Mapping[str, Any]) -> dict[str, Any]:
    """`{"memory_mb": 1}` -> `{"memoryMb": 1}` (top-level keys only)."""
    return {re.sub(r"_([a-z0-9])", lambda m: m[1].upper(), k): v for k, v in d.items()}


def snake(d: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `camel`."""
    return {re.sub(r"([A-Z])", lambda m: "_" + m[1].lower(), k): v for k, v in d.items()}


def sandbox_json(info: SandboxInfo) -> dict[str, Any]:
    """Our own view of a sandbox, the `k3sys` member of every E2B sandbox body the service sends."""
    return {"state": info.state, "spec": camel(info.spec.to_json()), "created": info.created, "head": info.head,
            "reason": info.reason, "deadline": info.deadline, "thenHibernate": info.then_hibernate}


def sandbox_info(d: Mapping[str, Any]) -> SandboxInfo:
    """The SandboxInfo of an E2B sandbox body from the service (its `sandboxID` and `k3sys` members;
    E2B's `metadata`, which the service keeps beside the spec, where the body carries it)."""
    k = d["k3sys"]
    spec = snake(k["spec"]) | ({"metadata": d["metadata"]} if isinstance(d.get("metadata"), dict) else {})
    return SandboxInfo(d["sandboxID"], k["state"], SandboxSpec.from_json(spec), k["created"], k["head"],
                       k["reason"], k["deadline"], k.get("thenHibernate") is True)


def checkpoint_json(ck: CheckpointInfo, names: list[str] | None = None) -> dict[str, Any]:
    """A checkpoint as E2B's SnapshotInfo (`snapshotID`, the `names` given to it) with our fields beside."""
    return {"snapshotID": ck.id, "names": names or [], **camel(dataclasses.asdict(ck))}


def checkpoint_info(d: Mapping[str, Any]) -> CheckpointInfo:
    fields = snake(d)
    return CheckpointInfo(**{k: fields[k] for k in CheckpointInfo.__dataclass_fields__})

