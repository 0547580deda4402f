"""The sandbox service's request and answer bodies (pydantic): strict, so an unknown field or a
wrong type is a 422 naming it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", strict=True)


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


class Prefetched(BaseModel):
    staged: bool


class CommandStarted(BaseModel):
    id: str


class CommandStatus(BaseModel):
    id: str
    pid: int  # inside the sandbox
    running: bool
    stdout: str
    stderr: str


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
