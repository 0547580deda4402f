"""Exceptions of `k3sys.sandbox`: one base, every failure a subclass that names the problem.

    SandboxError                          base of everything this package raises
    ├── NotFoundError (LookupError)       no sandbox / command with that id
    ├── InvalidStateError                 operation not allowed in the sandbox's current state
    ├── InvalidArgumentError (ValueError) bad argument: negative limit, bad id, ...
    │   ├── UnknownTemplateError          no template with that name
    │   ├── PathEscapeError               a sandbox path leaving the sandbox root (`..`, symlinks)
    │   ├── WrongFileTypeError            a directory where a file is needed, or the other way round
    │   └── TooLargeError                 a request body over the service's size limit
    ├── SandboxFileNotFoundError (FileNotFoundError)  no such file inside the sandbox
    ├── CommandTimeoutError (TimeoutError)  a command ran past its timeout and was killed
    ├── RuntimeLockedError                another live process holds the runtime directory
    ├── DriverError                       runc / CRIU / the kernel refused; carries the tool's log tail
    ├── AuthError                         the service refused the API key (missing or wrong)
    ├── CapacityError                     the service is at a limit (sandboxes, memory); retry later
    ├── UnavailableError                  the service is shutting down or cannot be reached
    └── StoreError                        the checkpoint store (`k3sys.sandbox.runtime.store`)
        ├── CheckpointNotFoundError       unknown checkpoint id (also a NotFoundError)
        ├── CheckpointExistsError         commit with an id that is already taken
        ├── StoreInputError               bad id, tree, destination or entry path (also a ValueError)
        └── CorruptStoreError             missing or damaged chunk, pack or manifest

Each class has a stable `code`, so a remote client rebuilds the same exception from an error body
(`error_from_code`).
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every error raised by `k3sys.sandbox`."""

    code = "sandbox_error"


class NotFoundError(SandboxError, LookupError):
    """No sandbox or command with the given id."""

    code = "not_found"


class InvalidStateError(SandboxError):
    """The operation is not allowed in the sandbox's current state (e.g. `run` while paused)."""

    code = "invalid_state"


class InvalidArgumentError(SandboxError, ValueError):
    """A bad argument; the message names the argument and the offending value."""

    code = "invalid_argument"


class UnknownTemplateError(InvalidArgumentError):
    """No template with that name."""

    code = "unknown_template"


class PathEscapeError(InvalidArgumentError):
    """A sandbox path that would resolve outside the sandbox's root (through `..` or a symlink)."""

    code = "path_escape"


class WrongFileTypeError(InvalidArgumentError):
    """A sandbox path names the wrong kind of file: a directory to read or write as a file, a file
    to list as a directory, a device or FIFO to read."""

    code = "wrong_file_type"


class SandboxFileNotFoundError(SandboxError, FileNotFoundError):
    """No such file or directory inside the sandbox."""

    code = "file_not_found"


class CommandTimeoutError(SandboxError, TimeoutError):
    """A command ran past its timeout and was killed; `stdout`/`stderr` hold what it wrote."""

    code = "command_timeout"

    def __init__(self, message: str, stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


class TooLargeError(InvalidArgumentError):
    """A request body over the service's size limit."""

    code = "too_large"


class AuthError(SandboxError):
    """The sandbox service refused the request's API key (missing or wrong)."""

    code = "unauthorized"


class CapacityError(SandboxError):
    """The sandbox service is at one of its limits (sandboxes, memory); retry after others finish."""

    code = "capacity"


class UnavailableError(SandboxError):
    """The sandbox service is shutting down or cannot be reached."""

    code = "unavailable"


class RuntimeLockedError(SandboxError):
    """Another live process holds this runtime directory."""

    code = "runtime_locked"


class DriverError(SandboxError):
    """The isolation layer (runc, CRIU, mounts, cgroups) failed; the message has the tool's log tail."""

    code = "driver_error"


class StoreError(SandboxError):
    """Base class of the checkpoint store's errors."""

    code = "store_error"


class CheckpointNotFoundError(StoreError, NotFoundError):
    """No checkpoint with the given id."""

    code = "checkpoint_not_found"


class CheckpointExistsError(StoreError):
    """A checkpoint with the given id already exists."""

    code = "checkpoint_exists"


class StoreInputError(StoreError, ValueError):
    """An argument is not acceptable: an id or tree name, a tree to commit, a checkout destination,
    or an entry path that would leave its tree."""

    code = "store_input"


class CorruptStoreError(StoreError):
    """Stored data is missing or does not match its hash."""

    code = "corrupt_store"


def error_from_code(code: str, message: str) -> SandboxError:
    """The exception a remote peer raised, rebuilt from its `code` (an unknown code gives the base)."""
    cls = _BY_CODE.get(code, SandboxError)
    return cls(message)


def _subclasses(cls: type[SandboxError]) -> list[type[SandboxError]]:
    return [cls] + [s for c in cls.__subclasses__() for s in _subclasses(c)]


_BY_CODE: dict[str, type[SandboxError]] = {c.code: c for c in _subclasses(SandboxError)}
