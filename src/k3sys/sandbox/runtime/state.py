"""Sandbox states and the record the runtime persists for each sandbox.

    creating -> running <-> paused
    running -> paused (then_hibernate) -> hibernating -> hibernated      (`pause(hibernate=True)`)
    running | paused -> checkpointing -> (back)        running | paused -> hibernating -> hibernated
    hibernated -> resuming -> running                   any -> killed (the record is removed)
    running | paused -> lost    (its processes died while no runtime watched)

The transitional states are written before the work starts, so a runtime restarted after a crash
knows what was in flight (`Record.prev` is where to roll back to, `Record.pending` the checkpoint id
being written) and settles it: back to `prev`, forward to `hibernated`, or `lost`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from k3sys.sandbox.spec import SandboxSpec


class State(StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    CHECKPOINTING = "checkpointing"
    HIBERNATING = "hibernating"
    HIBERNATED = "hibernated"
    RESUMING = "resuming"
    KILLED = "killed"
    LOST = "lost"


# The one transition table: state -> the states a sandbox in it may go to next (`SandboxTable.set`
# checks each change). A transitional state goes back to where it came from on failure; every state
# but `killed` may also end `killed` (the record goes) or `lost` (its processes died, or a kill failed
# and left something held).
_NEXT = {
    State.CREATING: {State.RUNNING},
    State.RUNNING: {State.PAUSED, State.CHECKPOINTING, State.HIBERNATING},
    State.PAUSED: {State.RUNNING, State.CHECKPOINTING, State.HIBERNATING},
    State.CHECKPOINTING: {State.RUNNING, State.PAUSED},
    State.HIBERNATING: {State.HIBERNATED, State.RUNNING, State.PAUSED},
    State.HIBERNATED: {State.RESUMING},
    State.RESUMING: {State.RUNNING, State.HIBERNATED},
    State.LOST: set(),
}
TRANSITIONS: dict[State, frozenset[State]] = {
    **{s: frozenset(nxt | {State.KILLED, State.LOST}) for s, nxt in _NEXT.items()}, State.KILLED: frozenset()}

# States in which the sandbox has live processes the caller may use.
LIVE = (State.RUNNING, State.PAUSED)


@dataclass
class Record:
    """What the runtime knows about one sandbox; `created` and `deadline` in unix seconds.

    `head` is the sandbox's latest checkpoint (the parent of its next one), `layer` the checkpoint
    whose sealed file system is its lower layer (None: the bare template); `sealed_bytes` what that
    layer (for a hibernated sandbox: `head`'s) holds of its `disk_mb` (`layers.tree_bytes`), reserved
    on the disk it gets at its next start so that the quota holds across them. `then_hibernate`: paused
    by `pause(hibernate=True)`, a background hibernation is queued or running (background.py); it
    survives a restart of the runtime, whose recovery queues the hibernation again. `hibernation`: the
    checkpoint of its latest pause (E2B's pause, a timeout's hibernation), the sandbox's own: not
    listed among checkpoints, dropped when a newer hibernation of it commits and when it is killed.
    """

    id: str
    spec: SandboxSpec
    state: State
    created: float
    deadline: float | None = None
    head: str | None = None
    layer: str | None = None
    prev: State | None = None
    pending: str | None = None
    sealed_bytes: int = 0
    reason: str = ""
    then_hibernate: bool = False
    hibernation: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def held_layers(self) -> set[str]:
        """The sealed layers this sandbox holds a reference to (layerset.py): the one it stands on,
        and for a hibernated or resuming one `head`'s, which its resume stacks the new upper onto."""
        held = {self.layer} if self.layer else set()
        if self.head and self.state in (State.HIBERNATED, State.RESUMING):
            held.add(self.head)
        return held

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = self.spec.to_json()
        d["state"] = self.state.value
        d["prev"] = self.prev.value if self.prev else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Record:
        d = dict(d)
        d["spec"] = SandboxSpec.from_json(d["spec"])
        d["state"] = State(d["state"])
        d["prev"] = State(d["prev"]) if d.get("prev") else None
        return cls(**d)

    def save(self, path: Path) -> None:
        """Write atomically: a runtime crash leaves the old record or the new one, never half of one.

        No fsync: records guard against the runtime process dying (the page cache survives that);
        a host crash kills every sandbox anyway, and checkpoints themselves are durable in the store.
        """
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Record:
        return cls.from_json(json.loads(path.read_text()))
