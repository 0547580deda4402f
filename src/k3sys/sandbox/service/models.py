"""The sandbox service's request and answer bodies (pydantic): strict, so an unknown field or a
wrong type is a 422 naming it."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from k3sys.sandbox.spec import MAX_FORK, SandboxSpec
from k3sys.sandbox.types import SandboxInfo

_STRICT = ConfigDict(extra="forbid", strict=True)


class Egress(BaseModel):
    """SandboxSpec.egress on the wire (k3sys.sandbox.egress.EgressPolicy checks the entries)."""

    model_config = _STRICT
    allow_out: list[str] = []
    deny_out: list[str] = []
    dns_servers: list[str] | None = None


# The create body is SandboxSpec's fields (defaults from there) plus an optional id; `egress` arrives
# as a plain object (strict mode takes no dict for a dataclass) and SandboxSpec makes it a policy.
_FIELD_TYPES = {**typing.get_type_hints(SandboxSpec), "egress": Egress | None}
CreateSandbox = create_model(
    "CreateSandbox", __config__=_STRICT, id=(str | None, None),
    **{f.name: (_FIELD_TYPES[f.name], f.default) for f in dataclasses.fields(SandboxSpec)})


class RunCommand(BaseModel):
    model_config = _STRICT
    cmd: str
    timeout: float | None = Field(60.0, description="seconds; null: the service's cap")
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin_base64: str | None = None
    background: bool = False


class Wait(BaseModel):
    model_config = _STRICT
    timeout: float | None = Field(None, description="seconds; null: the service's cap")


class Fork(BaseModel):
    model_config = _STRICT
    count: int = Field(1, ge=1, le=MAX_FORK, description="children to make")


class Prefetch(BaseModel):
    model_config = _STRICT
    ttl_s: float = Field(60.0, description="seconds the staged images are kept unless a resume uses them")


class Prefetched(BaseModel):
    staged: bool


class Restore(BaseModel):
    model_config = _STRICT
    id: str | None = None
    timeout_s: float | None = None


class CommandStarted(BaseModel):
    id: str


class CommandStatus(BaseModel):
    id: str
    pid: int  # inside the sandbox
    running: bool
    stdout: str
    stderr: str


class Forked(BaseModel):
    sandboxes: list[SandboxInfo]


class Written(BaseModel):
    path: str
    bytes: int


class Memory(BaseModel):
    bytes: int


class Cpu(BaseModel):
    seconds: float


class Health(BaseModel):
    status: Literal["ok", "draining"]
    version: str
