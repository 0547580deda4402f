"""Agent sandboxes with a managed life cycle (AgentENV-style): create, exec, files, pause, resume,
incremental checkpoint, fork, hibernate, restore. Imports no torch.

- `Sandbox`, `Checkpoint` (api.py): the SDK facade; `Runtime` (runtime.py): the embedded runtime
  behind it, over a driver (drivers/runc.py: runc + CRIU + overlayfs).
- `HTTPBackend`, `AsyncHTTPBackend` (client.py): the same SDK against a sandbox service
  (`k3sys.sandbox.service.server`, `k3sys sandbox serve`); `AsyncSandbox` (aio.py): the SDK for asyncio.
- `k3sys.sandbox.runtime.store`: the content-addressed chunk store behind incremental checkpoints.
- `k3sys.sandbox.errors`: the exception tree (`SandboxError` and subclasses).
"""

from k3sys.sandbox.errors import (
    AuthError,
    CapacityError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommandTimeoutError,
    CorruptStoreError,
    DriverError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    PathEscapeError,
    RuntimeLockedError,
    SandboxError,
    SandboxFileNotFoundError,
    StoreError,
    StoreInputError,
    TooLargeError,
    UnavailableError,
    UnknownTemplateError,
    WrongFileTypeError,
)
from k3sys.sandbox.sdk.aio import AsyncCommandHandle, AsyncSandbox
from k3sys.sandbox.sdk.api import Backend, Checkpoint, CommandHandle, Sandbox, default_runtime
from k3sys.sandbox.sdk.client import AsyncHTTPBackend, HTTPBackend
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, EntryInfo, SandboxInfo

__all__ = [
    "AsyncCommandHandle",
    "AsyncHTTPBackend",
    "AsyncSandbox",
    "AuthError",
    "Backend",
    "CapacityError",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CommandHandle",
    "CommandResult",
    "CommandTimeoutError",
    "CorruptStoreError",
    "DriverError",
    "EntryInfo",
    "HTTPBackend",
    "InvalidArgumentError",
    "InvalidStateError",
    "NotFoundError",
    "PathEscapeError",
    "Runtime",
    "RuntimeLockedError",
    "Sandbox",
    "SandboxError",
    "SandboxFileNotFoundError",
    "SandboxInfo",
    "SandboxSpec",
    "StoreError",
    "StoreInputError",
    "TooLargeError",
    "UnavailableError",
    "UnknownTemplateError",
    "WrongFileTypeError",
    "default_runtime",
]


def __getattr__(name: str) -> object:
    # `Runtime` loads the runtime, the store, numpy and blake3: only when asked for, so a remote-only
    # client (`from k3sys.sandbox import Sandbox` with an `api_url`) never pays for them.
    if name == "Runtime":
        from k3sys.sandbox.runtime.runtime import Runtime

        return Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
