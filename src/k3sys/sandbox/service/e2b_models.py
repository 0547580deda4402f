"""E2B's control-plane bodies as the service reads and writes them (E2B's spec/openapi.yml names the
fields; ours beside them, camelCase too). Requests are strict: an unknown field, a wrong type, or a
feature we do not serve is a 422 naming it, never silently dropped.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from k3sys.sandbox._wire import sandbox_json
from k3sys.sandbox.errors import InvalidArgumentError
from k3sys.sandbox.service.attrs import SandboxAttrs
from k3sys.sandbox.spec import MAX_FORK, SandboxSpec
from k3sys.sandbox.types import SandboxInfo

# The envd features the SDK turns on by this version (e2b/envd/versions.py): commands' stdin, the
# default user, octet-stream uploads, file metadata, recursive watch with entry info.
ENVD_VERSION = "0.6.4"
CLIENT_ID = "k3sys"
DEFAULT_TIMEOUT_S = 300  # E2B's default lifetime of a sandbox, when a create names none
NO_END = "9999-12-31T23:59:59Z"  # endAt of a sandbox without a deadline (E2B always has one)
MAX_TIMEOUT_S = 1e9
_MAX_PAIRS, _MAX_KEY, _MAX_VALUE = 256, 256, 16384  # metadata and envVars: entries, characters
# Metadata and envVars of one sandbox together, UTF-8 bytes of keys and values. The service keeps
# them in memory and a list page carries up to PAGE_MAX sandboxes' metadata, so this bounds a page
# at 6.4 MiB; envVars go into every command's environment, where Linux gives arguments and
# environment together a quarter of the stack limit (2 MiB by default): 64 KiB leaves a command most of it.
MAX_ATTRS_BYTES = 64 << 10
PAGE_MAX = 100  # items of one list page: E2B's default and maximum `limit`
# Keys of E2B's `network` object about who reaches the sandbox's ports, not about its egress.
TRAFFIC_KEYS = frozenset({"allowPublicTraffic", "maskRequestHost"})
_STRICT = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
# E2B's states are two; ours are finer (the `k3sys` member keeps ours).
E2B_STATE = {"running": "running", "checkpointing": "running", "creating": "running", "resuming": "running",
             "paused": "paused", "hibernating": "paused", "hibernated": "paused", "lost": "paused"}


def _pairs(name: str, d: dict[str, str] | None) -> dict[str, str]:
    d = d or {}
    if len(d) > _MAX_PAIRS:
        raise ValueError(f"{name}: at most {_MAX_PAIRS} entries, got {len(d)}")
    for k, v in d.items():
        if not k or len(k) > _MAX_KEY or len(v) > _MAX_VALUE:
            raise ValueError(f"{name}: keys of 1-{_MAX_KEY} and values of at most {_MAX_VALUE} characters, "
                             f"got {k[:40]!r} ({len(k)}) = ({len(v)} characters)")
    return d


def check_attrs_size(metadata: dict[str, str] | None, envs: dict[str, str] | None) -> None:
    """Refuse a sandbox whose metadata and envVars pass MAX_ATTRS_BYTES together."""
    size = sum(len(k.encode()) + len(v.encode()) for d in (metadata or {}, envs or {}) for k, v in d.items())
    if size > MAX_ATTRS_BYTES:
        raise InvalidArgumentError(f"metadata, envVars: {size} bytes of keys and values together, over the "
                                   f"bound of {MAX_ATTRS_BYTES} bytes per sandbox")


def unsupported(name: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{name}: not supported by this service ({why})")


class NewSandbox(BaseModel):
    """POST /sandboxes and /v2/sandboxes. `timeout` omitted: 300 s; null (ours): none. `autoPause`
    omitted: the service's `--on-timeout`. Ours: `sandboxID`, `cpu` (cores), `memoryMB`, `diskSizeMB`, `pids`."""

    model_config = _STRICT
    templateID: str = Field(min_length=1, max_length=255)
    timeout: float | None = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S, description="seconds")
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    autoResume: dict[str, Any] | None = None
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volumeMounts: list[dict[str, Any]] | None = None
    secure: bool | None = None  # E2B's v1 flag: an envd token; we always give one
    sandboxID: str | None = None
    cpu: float | None = None
    memoryMB: int | None = None
    diskSizeMB: int | None = None
    pids: int | None = None

    @field_validator("metadata", "envVars")
    @classmethod
    def _bounded(cls, v: dict[str, str] | None, info: Any) -> dict[str, str]:
        return _pairs(info.field_name, v)

    @property
    def auto_resume(self) -> bool:
        """E2B's `autoResume`: `{"enabled": true}` (SDK 2.x), or `{"policy": "any"}` (later SDKs)."""
        a = self.autoResume or {}
        return a.get("enabled") is True or a.get("policy") not in (None, "off")

    def check_supported(self) -> None:
        """Refuse what E2B offers and this service does not serve (rather than ignore it)."""
        if self.auto_resume and self.autoPause is not True:
            raise InvalidArgumentError("autoResume: only for a sandbox paused at its timeout (autoPause: true)")
        network = self.network or {}
        if not isinstance(network.get("allowPublicTraffic", True), bool | None):
            raise InvalidArgumentError(f"network.allowPublicTraffic: expected a boolean, got "
                                       f"{network['allowPublicTraffic']!r}")
        if network.get("maskRequestHost") is not None:
            raise unsupported("network.maskRequestHost", "the port proxy passes the client's Host on")
        for name in ("mcp", "iam", "volumeMounts"):
            if getattr(self, name):
                raise unsupported(name, "an E2B cloud feature")


class Timeout(BaseModel):
    model_config = _STRICT
    timeout: float = Field(ge=0, le=MAX_TIMEOUT_S, description="seconds from now")


class Connect(BaseModel):
    """POST /sandboxes/{id}/connect, /resume. `timeout` (seconds from now) only ever lengthens a
    running sandbox's life; `memory: false` (a cold boot) is refused."""

    model_config = _STRICT
    timeout: float | None = Field(None, ge=0, le=MAX_TIMEOUT_S)
    memory: bool | None = None
    autoPause: bool | None = None  # /resume's v1 body; the sandbox keeps its own on_timeout


class Pause(BaseModel):
    model_config = _STRICT
    memory: bool | None = None
    requireHealthyGuest: bool | None = None


class Snapshot(BaseModel):
    model_config = _STRICT
    name: str | None = Field(None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")
    memory: bool | None = None


class Fork(BaseModel):
    """`timeout` omitted: the children keep the source's (E2B's default is 15 s)."""

    model_config = _STRICT
    count: int = Field(1, ge=1, le=MAX_FORK)
    timeout: float | None = Field(None, ge=0, le=MAX_TIMEOUT_S)


class Restore(BaseModel):
    """POST /snapshots/{id}/restore (ours). `timeout` omitted: the checkpoint's spec's."""

    model_config = _STRICT
    sandboxID: str | None = None
    timeout: float | None = Field(None, ge=0, le=MAX_TIMEOUT_S)


class Prefetch(BaseModel):
    model_config = _STRICT
    ttlS: float = Field(60.0, description="seconds the staged images are kept unless used (the runtime checks it)")


def no_memory(memory: bool | None) -> None:
    """Refuse `memory: false` for a snapshot: a filesystem-only one (creates from it boot cold) is not
    served (a filesystem-only pause and a cold-boot resume are)."""
    if memory is False:
        raise unsupported("memory", "a snapshot always keeps the memory (filesystem-only snapshots are not served)")


def cpu_count(spec: SandboxSpec) -> int:
    """E2B's whole cores for our CFS quota (at least 1)."""
    return max(1, math.ceil(spec.cpu))


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def sandbox_body(info: SandboxInfo, attrs: SandboxAttrs, token: str | None, default_on_timeout: str,
                 traffic: str | None = None) -> dict[str, Any]:
    """One body for E2B's Sandbox, SandboxDetail and ListedSandbox (each ignores what it lacks), with
    our view of the sandbox in `k3sys`; `token`: its envd access token (None: envd asks for none);
    `traffic`: its traffic access token (None: its ports are public)."""
    spec = info.spec
    on_timeout = spec.on_timeout or default_on_timeout
    body: dict[str, Any] = {
        "templateID": attrs.template_id or spec.template, "alias": spec.template, "sandboxID": info.id,
        "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION, "domain": None,
        "startedAt": iso(info.created), "endAt": iso(info.deadline) if info.deadline is not None else NO_END,
        "cpuCount": cpu_count(spec), "memoryMB": spec.memory_mb, "diskSizeMB": spec.disk_mb,
        "state": E2B_STATE.get(info.state, "paused"), "metadata": attrs.metadata,
        "allowInternetAccess": spec.network,
        "lifecycle": {"autoResume": attrs.auto_resume, "onTimeout": "pause" if on_timeout == "hibernate" else "kill"},
        "k3sys": sandbox_json(info),
    }
    if token is not None:
        body["envdAccessToken"] = token
    if traffic is not None:
        body["trafficAccessToken"] = traffic
    if body["state"] == "paused":
        body["pauseMode"] = "full" if attrs.pause_memory else "filesystem"
    return body


def e2b_states(state: str | None) -> set[str] | None:
    """The `state` filter of a list (comma-separated E2B states), or None for every sandbox."""
    if not state:
        return None
    states = {s.strip() for s in state.split(",") if s.strip()}
    if bad := states - {"running", "paused"}:
        raise InvalidArgumentError(f"state: expected running and/or paused, got {sorted(bad)}")
    return states


Order = Literal["asc", "desc"]
