"""What a sandbox is asked to be (`SandboxSpec`) and what running a command gives back (`CommandResult`,
`OutputPieces` for its output as it streams)."""

from __future__ import annotations

import codecs
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from k3sys.sandbox.egress import EgressPolicy
from k3sys.sandbox.errors import InvalidArgumentError

ON_TIMEOUT = ("hibernate", "kill")  # what the runtime does with a sandbox past its `timeout_s`
_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


def check_id(what: str, value: object) -> str:
    """`value` if it is a usable id (lowercase letters, digits, `_.-`, at most 63 characters)."""
    if not isinstance(value, str) or not _ID.match(value):
        raise InvalidArgumentError(f"{what}: expected 1-63 characters of [a-z0-9_.-] starting with a letter or "
                                   f"digit, got {value!r}")
    return value


MAX_FORK = 256  # children of one fork call
# Most tasks of one sandbox: with the smallest per-process descriptor limit (64), its processes can
# hold at most MAX_PIDS x 64 = 131072 host descriptors, its budget (runtime/drivers/confine.py).
MAX_PIDS = 2048
MAX_DISK_MB = 1 << 18  # 256 GiB: a sandbox's writable layer at most


def check_number(name: str, value: object, lo: float, hi: float, unit: str, integer: bool = False) -> None:
    """InvalidArgumentError naming `name` unless `value` is a finite number (an int if `integer`) in [lo, hi]."""
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise InvalidArgumentError(f"{name}: expected {what} in [{lo:g}, {hi:g}] {unit}, got {value!r}")


@dataclass(frozen=True)
class SandboxSpec:
    """Resources and shape of a sandbox.

    `cpu` in cores (a CFS quota), `memory_mb` in MiB (a hard cgroup limit, no swap), `pids` the most
    tasks at once (at most MAX_PIDS), `network` False for a private network namespace with loopback
    only, True for one with a NAT route to the outside (docs/sandbox-network.md), `egress` what that
    route may reach (None: everything but the host and the metadata range); `timeout_s` the sandbox's
    lifetime in seconds (None: until killed); `on_timeout` what happens then: "kill", or "hibernate"
    (its time starts again on `resume`); None: the runtime's default; `disk_mb` the size of its
    writable layer in MiB (a file system of its own: writes past it get ENOSPC). `metadata` is the
    caller's, kept with the sandbox (E2B's); `envs` are added to every command the SDK starts in it.
    """

    template: str = "busybox"
    cpu: float = 1.0
    memory_mb: int = 512
    pids: int = 256
    network: bool = False
    timeout_s: float | None = None
    on_timeout: str | None = None
    disk_mb: int = 2048
    egress: EgressPolicy | None = None
    metadata: dict[str, str] = field(default_factory=dict, compare=False)
    envs: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or not self.template:
            raise InvalidArgumentError(f"template: expected a template name, got {self.template!r}")
        check_number("cpu", self.cpu, 0.01, 1024, "cores")
        check_number("memory_mb", self.memory_mb, 16, 1 << 20, "MiB", integer=True)
        check_number("pids", self.pids, 8, MAX_PIDS, "tasks", integer=True)
        if not isinstance(self.network, bool):
            raise InvalidArgumentError(f"network: expected a bool, got {self.network!r}")
        if self.timeout_s is not None:
            check_number("timeout_s", self.timeout_s, 1e-3, 1e9, "seconds (or None)")
        check_number("disk_mb", self.disk_mb, 64, MAX_DISK_MB, "MiB", integer=True)
        if self.on_timeout not in ON_TIMEOUT + (None,):
            raise InvalidArgumentError(f"on_timeout: expected one of {ON_TIMEOUT} or None, got {self.on_timeout!r}")
        for name in ("metadata", "envs"):
            pairs = getattr(self, name)
            if not isinstance(pairs, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                      for k, v in pairs.items()):
                raise InvalidArgumentError(f"{name}: expected a dict of non-empty str to str, got {pairs!r}")
        check_command("true", None, self.envs)
        if self.egress is not None:  # a dict from JSON (from_json, the service's create body)
            object.__setattr__(self, "egress", EgressPolicy.from_json(self.egress))
            if not self.network:
                raise InvalidArgumentError("egress: a policy needs network=True (network=False has loopback only)")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxSpec:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class CommandResult:
    """A finished command: its output (decoded as UTF-8, undecodable bytes replaced) and exit code.

    `exit_code` is 128 + the signal's number when the command was killed by one (as a shell says).
    `dropped` counts output bytes the sandbox dropped before they were read (a background command's
    oldest output, nobody following it, past its ring); output that was followed is never dropped.
    """

    stdout: str
    stderr: str
    exit_code: int
    dropped: int = 0
    error: str | None = None  # E2B's field: why the command could not run, when known (else None)


class OutputPieces:
    """Turns a command's raw output increments into `("stdout" | "stderr", text)` pieces.

    UTF-8 is decoded incrementally, so a character split across two increments comes out whole
    (undecodable bytes become U+FFFD, as in `CommandResult`). `offsets` are the bytes consumed so far.
    """

    def __init__(self) -> None:
        self.offsets = (0, 0)
        self._decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(2)]

    def feed(self, out: bytes, err: bytes, final: bool = False) -> list[tuple[str, str]]:
        self.offsets = (self.offsets[0] + len(out), self.offsets[1] + len(err))
        texts = [d.decode(b, final=final) for d, b in zip(self._decoders, (out, err), strict=True)]
        return [(name, t) for name, t in zip(("stdout", "stderr"), texts, strict=True) if t]


def check_command(cmd: str, cwd: str | None, env: dict[str, str] | None) -> dict[str, str]:
    """A command's arguments checked, embedded and by the remote client alike (InvalidArgumentError
    naming the bad one); `env` copied."""
    if not isinstance(cmd, str) or not cmd:
        raise InvalidArgumentError(f"cmd: expected a non-empty string, got {cmd!r}")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
        raise InvalidArgumentError(f"cwd: expected an absolute path in the sandbox, got {cwd!r}")
    env = dict(env or {})
    for k, v in env.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str) or "\0" in v:
            raise InvalidArgumentError(f"env: bad variable {k!r}={v!r}")
    return env
