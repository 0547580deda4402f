"""The checkpoints in the store as the runtime lists, reads and deletes them, and what each one's
sealed file system holds of a sandbox's disk.

A sealed layer is what the sandbox wrote (layers.py: flattened against the template), so it counts
against the sandbox's disk: its bytes (`layers.tree_bytes`) go with the sandbox's record
(`Record.sealed_bytes`) and into the checkpoint's manifest (`FS_BYTES`), and are reserved on the
disk of every sandbox that starts on it (resume, restore, fork: drivers/disk.py `reserve`). A
sandbox's own checkpoint (its pause's, `Record.hibernation`) is marked `INTERNAL`: not listed.
"""

from __future__ import annotations

import contextlib

from k3sys.sandbox.errors import CheckpointNotFoundError, InvalidStateError
from k3sys.sandbox.runtime import layers
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.state import State
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.types import CheckpointInfo

FS_BYTES = "fs_bytes"  # manifest meta: `layers.tree_bytes` of the checkpoint's sealed fs
INTERNAL = "internal"  # manifest meta: a sandbox's own checkpoint, not listed as a snapshot


class Catalog:
    """The checkpoints of `store` (see the module docstring); `table` says which a sandbox needs."""

    def __init__(self, table: SandboxTable, store: Store, layer_set: LayerSet) -> None:
        self.table = table
        self.store = store
        self.layers = layer_set

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint in the store, oldest first, but the sandboxes' own (`Record.hibernation`)."""
        return [CheckpointInfo.from_manifest(m) for m in self.store.list() if not m.meta.get(INTERNAL)]

    def get(self, ck: str) -> CheckpointInfo:
        return CheckpointInfo.from_manifest(self.store.get(ck))

    def has(self, ck: str) -> bool:
        try:
            self.store.get(ck)
            return True
        except CheckpointNotFoundError:
            return False

    def delete(self, ck: str) -> None:
        """Remove a checkpoint from the store; refused while a hibernated (or resuming) sandbox needs it."""
        users = [r for r in self.table.records() if r.head == ck and r.state in (State.HIBERNATED, State.RESUMING)]
        if users:
            raise InvalidStateError(f"checkpoint {ck} holds {users[0].state} sandbox {users[0].id}; "
                                    "kill or resume it first")
        self.store.delete(ck)  # its layer, if sandboxes stand on it, goes with the last of them

    def drop_own(self, ck: str | None) -> None:
        """Delete a sandbox's own checkpoint it no longer needs (superseded, or the sandbox killed). The
        store keeps the chunks a later checkpoint shares with it; one a hibernated sandbox still
        resumes from stays."""
        if ck is not None:
            with contextlib.suppress(CheckpointNotFoundError, InvalidStateError):
                self.delete(ck)

    def fs_bytes(self, ck: str) -> int:
        """What checkpoint `ck`'s sealed fs holds of a sandbox's disk: as measured when it was sealed,
        or (a checkpoint from before that was recorded) measured on its layer now."""
        held = self.store.get(ck).meta.get(FS_BYTES)
        if held is not None:
            return int(held)
        with self.layers.held(ck) as layer:
            return layers.tree_bytes(layer)
