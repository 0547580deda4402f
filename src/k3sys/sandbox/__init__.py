"""Agent sandboxes with a managed life cycle (AgentENV-style): create, exec, files, pause, resume,
incremental checkpoint, fork, hibernate, restore. Imports no torch. Three rooms:

- `sdk/`: `Sandbox`, `Checkpoint` (api.py), `AsyncSandbox`, `AsyncCheckpoint` (aio.py), the HTTP
  backends `HTTPBackend` and `AsyncHTTPBackend` (client.py) and `ConnectionConfig` (connection.py).
- `service/`: the HTTP service (`k3sys sandbox serve`): server.py (routes), core.py (the runtime's
  worker threads, limits, metrics), auth.py, tenants.py (API keys, owners, quotas), limits.py,
  guard.py (connection and header-time limits), metrics.py.
- `runtime/`: `Runtime`, the embedded runtime (runtime.py and its parts: commands, files,
  checkpoints, recovery), over a driver (drivers/: runc + CRIU + overlayfs, cgroups, network) and the
  content-addressed checkpoint store (store/).

Shared by all three: errors.py (the exception tree, each class with its HTTP status and CLI exit
code, and E2B's exception names for its classes), spec.py (`SandboxSpec`, `CommandResult`),
egress.py (`EgressPolicy`), types.py (`SandboxInfo`, `CheckpointInfo`, `EntryInfo`), _wire.py (the
service's JSON and error bodies).
`Runtime` is imported on first use, so `import k3sys.sandbox` for a remote client loads neither the
runtime nor the store.
"""

from k3sys.sandbox.egress import EgressPolicy
from k3sys.sandbox.errors import (
    AuthenticationException,
    AuthError,
    CapacityError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommandExitError,
    CommandExitException,
    CommandTimeoutError,
    CorruptStoreError,
    DriverError,
    FileNotFoundException,
    InvalidArgumentError,
    InvalidArgumentException,
    InvalidStateError,
    NotEnoughSpaceException,
    NotFoundError,
    NotFoundException,
    PathEscapeError,
    QuotaError,
    RateLimitException,
    RuntimeLockedError,
    SandboxError,
    SandboxException,
    SandboxFileNotFoundError,
    SandboxLimitError,
    SandboxNotFoundException,
    SandboxNotRunningException,
    ServiceBusyException,
    StoreError,
    StoreInputError,
    TimeoutException,
    TooLargeError,
    UnavailableError,
    UnknownTemplateError,
    WrongFileTypeError,
)
from k3sys.sandbox.sdk.aio import AsyncCheckpoint, AsyncCommandHandle, AsyncSandbox
from k3sys.sandbox.sdk.api import Backend, Checkpoint, CommandHandle, Sandbox, SandboxList, WriteInfo, default_runtime
from k3sys.sandbox.sdk.client import AsyncHTTPBackend, HTTPBackend
from k3sys.sandbox.sdk.connection import ConnectionConfig
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, EntryInfo, FilesystemEvent, ProcessInfo, SandboxInfo

__all__ = [
    "AsyncCheckpoint",
    "AsyncCommandHandle",
    "AsyncHTTPBackend",
    "AsyncSandbox",
    "AuthError",
    "AuthenticationException",
    "Backend",
    "CapacityError",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CommandExitError",
    "CommandExitException",
    "CommandHandle",
    "CommandResult",
    "CommandTimeoutError",
    "ConnectionConfig",
    "CorruptStoreError",
    "DriverError",
    "EgressPolicy",
    "EntryInfo",
    "FileNotFoundException",
    "FilesystemEvent",
    "HTTPBackend",
    "InvalidArgumentError",
    "InvalidArgumentException",
    "InvalidStateError",
    "NotEnoughSpaceException",
    "NotFoundError",
    "NotFoundException",
    "PathEscapeError",
    "ProcessInfo",
    "QuotaError",
    "RateLimitException",
    "Runtime",
    "RuntimeLockedError",
    "Sandbox",
    "SandboxError",
    "SandboxException",
    "SandboxFileNotFoundError",
    "SandboxInfo",
    "SandboxLimitError",
    "SandboxList",
    "SandboxNotFoundException",
    "SandboxNotRunningException",
    "SandboxSpec",
    "ServiceBusyException",
    "StoreError",
    "StoreInputError",
    "TimeoutException",
    "TooLargeError",
    "UnavailableError",
    "UnknownTemplateError",
    "WriteInfo",
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
