"""The sandbox service's request and answer bodies (pydantic): strict, so an unknown field or a
wrong type is a 422 naming it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

_STRICT = ConfigDict(extra="forbid", strict=True)


class Prefetched(BaseModel):
    staged: bool


class Memory(BaseModel):
    bytes: int


class Cpu(BaseModel):
    seconds: float


class Health(BaseModel):
    status: Literal["ok", "draining"]
    version: str
