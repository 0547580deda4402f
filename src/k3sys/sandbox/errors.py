"""Exceptions of `k3sys.sandbox`: one base, every failure a subclass that names the problem.

    SandboxError                          base of everything this package raises
    ├── NotFoundError (LookupError)       no sandbox / command with that id
    ├── InvalidStateError                 operation not allowed in the sandbox's current state
    ├── InvalidArgumentError (ValueError) bad argument: negative limit, bad id, ...
    │   ├── UnknownTemplateError          no template with that name
    │   ├── PathEscapeError               a sandbox path leaving the sandbox root (`..`, symlinks)
    │   ├── WrongFileTypeError            a directory where a file is needed, or the other way round
    │   ├── TooLargeError                 a request body, or a `run`'s output, over its size limit
    │   ├── ImageError                    an OCI / docker image that cannot be read or is refused
    │   │   └── LayerEntryError           a layer's tar entry refused (names the layer and the entry)
    │   └── DockerfileError               a Dockerfile instruction refused (names it and its line)
    ├── SandboxFileNotFoundError (FileNotFoundError)  no such file inside the sandbox
    ├── CommandTimeoutError (TimeoutError)  a command ran past its timeout and was killed
    ├── CommandExitError                  the SDK's `commands.run` / `wait`: the command exited non-zero
    ├── RuntimeLockedError                another live process holds the runtime directory
    ├── BuildError                        a template build step failed (a RUN's exit code and output)
    ├── DriverError                       runc / CRIU / the kernel refused; carries the tool's log tail
    ├── TemplateStartError                a warm template's start command exited or never got ready
    ├── PermissionDeniedError (PermissionError)  the sandbox itself refused (EPERM, EACCES inside it)
    ├── AgentError                        the in-sandbox agent failed or cannot be reached
    │   ├── AgentInterruptedError         a call cut by a checkpoint / hibernate of its sandbox: retry
    │   └── AgentTimeoutError             the agent left a call unanswered past its deadline (stuck)
    ├── AuthError                         the service refused the API key (missing or wrong)
    ├── CapacityError                     the service is at a limit (sandboxes, memory); retry later
    │   ├── QuotaError                    the caller's tenant is at one of its quotas (named in the message)
    │   └── SandboxLimitError             the sandbox is at one of its own limits (watches, inotify, descriptors)
    ├── UnavailableError                  the service is shutting down or cannot be reached
    └── StoreError                        the checkpoint store (`k3sys.sandbox.runtime.store`)
        ├── CheckpointNotFoundError       unknown checkpoint id (also a NotFoundError)
        ├── CheckpointExistsError         commit with an id that is already taken
        ├── StoreInputError               bad id, tree, destination or entry path (also a ValueError)
        └── CorruptStoreError             missing or damaged chunk, pack or manifest

Each class carries what every layer needs to know about it, in one place: a stable `code` (the error
body's `type`, so a remote client rebuilds the same exception: `error_from_code`), the `http_status`
the service answers with, and the `exit_code` of the `k3sys sandbox` CLI. Subclasses inherit them
(a `CheckpointNotFoundError` is a 404 and exits 3 as a `NotFoundError`); `StoreInputError` is
a 422 like `InvalidArgumentError` but exits 1, as it always has:

    http_status  404 not found (sandbox, command, checkpoint, file)   409 invalid_state, checkpoint_exists
                 422 invalid_argument and its subclasses, store_input  413 too_large   408 command_timeout
                 401 unauthorized   403 permission_denied   429 capacity, quota_exceeded, sandbox_limit
                 503 unavailable, runtime_locked, agent_interrupted   504 agent_timeout   500 everything else
    exit_code    2 bad argument   3 not found   4 wrong state   5 key refused   6 at a limit
                 7 unavailable or busy   1 everything else
"""

from __future__ import annotations

MAX_MESSAGE = 2000  # characters of an error message; the middle of a longer one is cut


class SandboxError(Exception):
    """Base class of every error raised by `k3sys.sandbox`. Its message is at most `MAX_MESSAGE`
    characters: messages quote the values they refuse, and a 100k-character path must not come back
    100k characters long (in an answer, a log line, a terminal)."""

    code = "sandbox_error"
    http_status: int = 500  # what the service answers with (the tree in the module docstring)
    exit_code: int = 1  # what `k3sys sandbox` exits with

    def __str__(self) -> str:
        s = super().__str__()
        if len(s) <= MAX_MESSAGE:
            return s
        return f"{s[:MAX_MESSAGE - 400]} ... ({len(s) - MAX_MESSAGE + 300} characters cut) ... {s[-300:]}"


class NotFoundError(SandboxError, LookupError):
    """No sandbox or command with the given id."""

    code = "not_found"
    http_status = 404
    exit_code = 3


class InvalidStateError(SandboxError):
    """The operation is not allowed in the sandbox's current state (e.g. `run` while paused)."""

    code = "invalid_state"
    http_status = 409
    exit_code = 4


class InvalidArgumentError(SandboxError, ValueError):
    """A bad argument; the message names the argument and the offending value."""

    code = "invalid_argument"
    http_status = 422
    exit_code = 2


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


class ImageError(InvalidArgumentError):
    """An OCI image layout, OCI / `docker save` archive or registry image that cannot be read, or
    whose manifest, config or blobs are refused (a digest that does not match, a missing blob)."""

    code = "bad_image"


class LayerEntryError(ImageError):
    """A tar entry of an image layer that would land outside the root file system or is not allowed
    there (`..` or an absolute path, a link to outside, a device node, a write through a symlink)."""

    code = "bad_layer_entry"


class DockerfileError(InvalidArgumentError):
    """A Dockerfile that cannot be built: a syntax error, an unsupported instruction or a bad
    argument; the message names the instruction and its line."""

    code = "bad_dockerfile"


class SandboxFileNotFoundError(SandboxError, FileNotFoundError):
    """No such file or directory inside the sandbox."""

    code = "file_not_found"
    http_status = 404
    exit_code = 3


class CommandTimeoutError(SandboxError, TimeoutError):
    """A command ran past its timeout and was killed; `stdout`/`stderr` hold what it wrote."""

    code = "command_timeout"
    http_status = 408

    def __init__(self, message: str, stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


class CommandExitError(SandboxError):
    """A command the SDK ran (`commands.run`, `CommandHandle.wait`) exited with a non-zero code, as
    E2B's SDK raises it (its `CommandExitException`): `stdout`, `stderr`, `exit_code` (128 + N when
    signal N ended it) and `error` are the command's `CommandResult`. Raised on the client side only."""

    code = "command_exit"

    def __init__(self, message: str = "", stdout: str = "", stderr: str = "", exit_code: int = 1,
                 error: str | None = None) -> None:
        super().__init__(message or f"command exited with code {exit_code}" + (f": {stderr}" if stderr else ""))
        self.stdout, self.stderr, self.exit_code, self.error = stdout, stderr, exit_code, error


class TooLargeError(InvalidArgumentError):
    """A request body over the service's size limit, or a command's output over `run`'s."""

    code = "too_large"
    http_status = 413


class AuthError(SandboxError):
    """The sandbox service refused the request's API key (missing or wrong)."""

    code = "unauthorized"
    http_status = 401
    exit_code = 5


class CapacityError(SandboxError):
    """The sandbox service is at one of its limits (sandboxes, memory); retry after others finish."""

    code = "capacity"
    http_status = 429
    exit_code = 6


class QuotaError(CapacityError):
    """The caller's tenant is at one of its quotas (sandboxes, memory_mb, disk_mb, pids: the message
    names it, with the use and the bound); kill or hibernate some of its sandboxes, or ask for more."""

    code = "quota_exceeded"


class SandboxLimitError(CapacityError):
    """The sandbox is at one of its own limits: its API watches, the inotify instances or watches
    of a user inside it, its descriptors, its disk (the message names the limit, with the bound);
    end some (stop a watch, close files, delete files) and retry."""

    code = "sandbox_limit"


class UnavailableError(SandboxError):
    """The sandbox service is shutting down or cannot be reached."""

    code = "unavailable"
    http_status = 503
    exit_code = 7


class RuntimeLockedError(SandboxError):
    """Another live process holds this runtime directory."""

    code = "runtime_locked"
    http_status = 503
    exit_code = 7


class BuildError(SandboxError):
    """A template build step failed: a RUN exited non-zero (the message holds its output's tail), a
    COPY source is missing. No template is left behind. 422: the build's own steps failed (the
    service hands it to E2B's SDK in the build's status: service/template_builds.py)."""

    code = "build_failed"
    http_status = 422


class DriverError(SandboxError):
    """The isolation layer (runc, CRIU, mounts, cgroups) failed; the message has the tool's log tail."""

    code = "driver_error"


class TemplateStartError(SandboxError):
    """A template's start command exited, or its ready command did not pass in time, while its warm
    checkpoint was built (runtime/warm.py); the message carries both commands' output."""

    code = "template_start"
    http_status = 422


class PermissionDeniedError(SandboxError, PermissionError):
    """The sandbox refused the operation as it would refuse its own user (EPERM, EACCES inside it:
    a device node the sandbox may not open, a file the requested user may not write)."""

    code = "permission_denied"
    http_status = 403


class AgentError(SandboxError):
    """The sandbox's agent (its PID 1) failed or cannot be reached; the message says which."""

    code = "agent_error"


class AgentInterruptedError(AgentError):
    """A call to the agent was cut because its sandbox is being checkpointed, hibernated or killed;
    nothing was lost inside the sandbox and the same call can be made again."""

    code = "agent_interrupted"
    http_status = 503
    exit_code = 7


class AgentTimeoutError(AgentError):
    """The sandbox's agent left a call unanswered past its deadline (runtime/agent_link.py: stopped,
    or overloaded far beyond a slow machine); the message names the sandbox. The sandbox can still
    be killed; a checkpoint, pause or hibernation of it failed and left it as it was."""

    code = "agent_timeout"
    http_status = 504
    exit_code = 7


class StoreError(SandboxError):
    """Base class of the checkpoint store's errors."""

    code = "store_error"


class CheckpointNotFoundError(StoreError, NotFoundError):
    """No checkpoint with the given id."""

    code = "checkpoint_not_found"


class CheckpointExistsError(StoreError):
    """A checkpoint with the given id already exists."""

    code = "checkpoint_exists"
    http_status = 409


class StoreInputError(StoreError, ValueError):
    """An argument is not acceptable: an id or tree name, a tree to commit, a checkout destination,
    or an entry path that would leave its tree."""

    code = "store_input"
    http_status = 422
    exit_code = 1


class CorruptStoreError(StoreError):
    """Stored data is missing or does not match its hash."""

    code = "corrupt_store"


def error_from_code(code: str, message: str) -> SandboxError:
    """The exception a remote peer raised, rebuilt from its `code` (an unknown code gives the base)."""
    cls = _BY_CODE.get(code, SandboxError)
    return cls(message)


def error_classes() -> list[type[SandboxError]]:
    """Every class of the tree, each parent before its children (the module docstring's order)."""
    return _subclasses(SandboxError)


def _subclasses(cls: type[SandboxError]) -> list[type[SandboxError]]:
    seen: dict[type[SandboxError], None] = {cls: None}  # a class with two parents in the tree appears once
    for c in cls.__subclasses__():
        seen |= dict.fromkeys(_subclasses(c))
    return list(seen)


_BY_CODE: dict[str, type[SandboxError]] = {c.code: c for c in error_classes()}


# E2B's exception names (its `e2b/exceptions.py`), so `except TimeoutException` in code written for
# `e2b` catches what k3sys raises for the same failure. Each names the k3sys class nearest in meaning:
# E2B's TimeoutException is chiefly a command's deadline, its NotEnoughSpaceException a sandbox's
# disk (one of its own limits), its RateLimitException any 429 of the API, ServiceBusy its 503.
SandboxException = SandboxError
TimeoutException = CommandTimeoutError
InvalidArgumentException = InvalidArgumentError
NotEnoughSpaceException = SandboxLimitError
NotFoundException = NotFoundError
SandboxNotFoundException = NotFoundError
FileNotFoundException = SandboxFileNotFoundError
SandboxNotRunningException = InvalidStateError
CommandExitException = CommandExitError
AuthenticationException = AuthError
RateLimitException = CapacityError
ServiceBusyException = UnavailableError
E2B_NAMES = ("SandboxException", "TimeoutException", "InvalidArgumentException", "NotEnoughSpaceException",
             "NotFoundException", "SandboxNotFoundException", "FileNotFoundException", "SandboxNotRunningException",
             "CommandExitException", "AuthenticationException", "RateLimitException", "ServiceBusyException")
