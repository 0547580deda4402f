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
# The create body is SandboxSpec's fields (defaults from there) plus an optional id.
CreateSandbox = create_model(
    "CreateSandbox", __config__=_STRICT, id=(str | None, None),
    **{f.name: (typing.get_type_hints(SandboxSpec)[f.name], f.default) for f in dataclasses.fields(SandboxSpec)})


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


class Forked(BaseModel):
    sandboxes: list[SandboxInfo]


class Memory(BaseModel):
    bytes: int


class Cpu(BaseModel):
    seconds: float


class Health(BaseModel):
    status: Literal["ok", "draining"]
    version: str
