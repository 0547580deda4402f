"""Sealed layers: the file systems of checkpoints that sandboxes stand on as their lower layer
(`<runtime>/layers/<checkpoint id>`), checked out of the store when needed, collected when no
sandbox stands on them, and what each holds of its sandbox's `disk_mb`.

A sealed layer is what the sandbox wrote (layers.py: flattened against the template), so it counts
against the sandbox's disk: its bytes (`layers.tree_bytes`) go with the sandbox's record
(`Record.sealed_bytes`) and into the checkpoint's manifest (`fs_bytes`), and are reserved on the
disk of every sandbox that starts on it (resume, restore, fork: drivers/disk.py `reserve`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from k3sys.sandbox.runtime import layers
from k3sys.sandbox.runtime.state import State
from k3sys.sandbox.runtime.table import Table, _rmtree

FS_BYTES = "fs_bytes"  # manifest meta: `layers.tree_bytes` of the checkpoint's sealed fs


class SealedLayers(Table):
    """`Runtime`'s sealed layers (see the module docstring)."""

    def _ensure_layer(self, ck: str) -> Path:
        """The sealed fs of checkpoint `ck` as a layer directory, checked out of the store if needed."""
        layer = self._layer_dir(ck)
        if not layer.exists():
            tmp = self.root / "tmp" / f"{ck}-fs-{secrets.token_hex(4)}"
            self.store.checkout(ck, {"fs": tmp})
            try:
                os.rename(tmp, layer)
            except OSError:  # another thread checked it out first
                _rmtree(tmp)
        return layer

    def _fs_bytes(self, ck: str) -> int:
        """What checkpoint `ck`'s sealed fs holds of a sandbox's disk: as measured when it was sealed,
        or (a checkpoint from before that was recorded) measured on its layer now."""
        held = self.store.get(ck).meta.get(FS_BYTES)
        return int(held) if held is not None else layers.tree_bytes(self._ensure_layer(ck))

    def _gc_layers(self) -> None:
        """Remove sealed layers no sandbox stands on (or will resume onto)."""
        with self._mu:
            used = {r.layer for r in self._records.values()} | {
                r.head for r in self._records.values() if r.state in (State.HIBERNATED, State.RESUMING)}
            used |= {r.pending for r in self._records.values()}
        for d in (self.root / "layers").iterdir():
            if d.name not in used:
                _rmtree(d)
