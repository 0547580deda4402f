"""What the sandbox API hands back, shared by the SDK, the service and the runtime: `SandboxInfo`,
`CheckpointInfo`, `EntryInfo`. Plain dataclasses that import nothing heavy, so a remote-only client
(`k3sys.sandbox.sdk.client`) loads neither the runtime nor the store (no numpy, no blake3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from k3sys.sandbox.spec import SandboxSpec

if TYPE_CHECKING:
    from k3sys.sandbox.runtime.store import Manifest


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as callers see it; `created` and `deadline` (when its `on_timeout` applies; None:
    never) in unix seconds. `then_hibernate`: "paused" or "hibernating" on its way to "hibernated"
    in the background (`pause(hibernate=True)`): frozen, its memory still held."""

    id: str
    state: str
    spec: SandboxSpec
    created: float
    head: str | None
    reason: str = ""
    deadline: float | None = field(default=None, compare=False)
    then_hibernate: bool = field(default=False, compare=False)

    @property
    def sandbox_id(self) -> str:
        """E2B's name of `id`."""
        return self.id

    @property
    def template_id(self) -> str:
        return self.spec.template

    @property
    def metadata(self) -> dict[str, str]:
        return self.spec.metadata


@dataclass(frozen=True)
class CheckpointInfo:
    """A stored checkpoint; `created` in unix seconds, sizes in bytes (`bytes_new`: what this
    checkpoint added to the store), `timings` seconds per phase when this runtime took it."""

    id: str
    parent: str | None
    created: float
    bytes_total: int
    bytes_new: int
    sandbox_id: str
    template: str
    timings: dict[str, float] = field(default_factory=dict, compare=False)

    @classmethod
    def from_manifest(cls, m: Manifest, timings: dict[str, float] | None = None) -> CheckpointInfo:
        return cls(m.id, m.parent, m.created, m.bytes_total, m.bytes_new, m.meta.get("sandbox", ""),
                   m.meta.get("spec", {}).get("template", ""), timings or {})


@dataclass(frozen=True)
class ProcessInfo:
    """One process the sandbox's agent started and still holds (`commands.list`): its pid inside,
    the command (argv joined by spaces), the client's tag, and its exit code once ended (128 + N
    after signal N)."""

    pid: int
    cmd: str
    tag: str
    running: bool
    exit_code: int | None = None
    pty: bool = False  # runs on a terminal


@dataclass(frozen=True)
class FilesystemEvent:
    """One change seen by `files.watch_dir`: `type` "create" (also a name moved in), "write",
    "remove", "rename" (a name moved away) or "chmod"; `path` absolute in the sandbox."""

    type: str
    path: str
    is_dir: bool = False


@dataclass(frozen=True)
class EntryInfo:
    """One entry of `files.list`: `size` in bytes, `mtime` in seconds since the epoch, `uid`/`gid`
    its owner's ids inside the sandbox, `target` a symlink's target (else None), `xattrs` its user.*
    extended attributes as sorted (name, value) pairs."""

    name: str
    path: str
    type: str  # "file", "dir", "symlink" or "other"
    size: int
    mode: int
    mtime: float
    uid: int = 0
    gid: int = 0
    target: str | None = None
    xattrs: tuple[tuple[str, bytes], ...] = ()
