"""Sealed layers: the file systems of checkpoints that sandboxes stand on as their lower layer
(`<runtime>/layers/<checkpoint id>`, reference-counted: layerset.py), and what each holds of its
sandbox's `disk_mb`.

A sealed layer is what the sandbox wrote (layers.py: flattened against the template), so it counts
against the sandbox's disk: its bytes (`layers.tree_bytes`) go with the sandbox's record
(`Record.sealed_bytes`) and into the checkpoint's manifest (`fs_bytes`), and are reserved on the
disk of every sandbox that starts on it (resume, restore, fork: drivers/disk.py `reserve`).
"""

from __future__ import annotations

from k3sys.sandbox.runtime import layers
from k3sys.sandbox.runtime.base import Base

FS_BYTES = "fs_bytes"  # manifest meta: `layers.tree_bytes` of the checkpoint's sealed fs


class SealedLayers(Base):
    """`Runtime`'s sealed layers (see the module docstring)."""

    def _fs_bytes(self, ck: str) -> int:
        """What checkpoint `ck`'s sealed fs holds of a sandbox's disk: as measured when it was sealed,
        or (a checkpoint from before that was recorded) measured on its layer now."""
        held = self.store.get(ck).meta.get(FS_BYTES)
        if held is not None:
            return int(held)
        with self.layers.held(ck) as layer:
            return layers.tree_bytes(layer)
