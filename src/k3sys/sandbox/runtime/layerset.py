"""The sealed layers sandboxes stand on (`<runtime>/layers/<checkpoint id>`), counted by reference.

A layer is the sealed file system of a checkpoint (layers.py), checked out of the store, or moved in
by the hibernation or fork that sealed it. Each sandbox record holds references (`Record.layers()`:
the layer it stands on; for a hibernated or resuming one, the layer its resume stacks onto) and an
operation holds one for as long as it works with a layer that no record holds yet (a fork's layer
while its children start). The table turns each record change into `update` (acquire the new
references, then release the old), so a count is exactly the number of holders.

The last release deletes: under the set's lock the directory is renamed into the staging directory
and the entry dropped, and only the renamed tree is removed after the lock is released, so two
releases never remove the same tree, and an acquire after the release checks the layer out afresh
instead of mounting a tree being removed. There is no scan-and-delete while the runtime runs; at
startup, recovery rebuilds the counts from the records and `sweep` removes the unheld rest.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from k3sys.sandbox.runtime.trees import new_id, remove_tree


class _Entry:
    """One layer's count, and a lock that orders the check-out or move-in of its directory."""

    __slots__ = ("count", "fill")

    def __init__(self) -> None:
        self.count = 0
        self.fill = threading.Lock()


class LayerSet:
    """Reference-counted layer directories under `root`; `checkout(ck, dest)` writes checkpoint `ck`'s
    sealed fs into the new directory `dest` (the store's); `staging` is on the same file system as
    `root` (renames)."""

    def __init__(self, root: Path, staging: Path, checkout: Callable[[str, Path], None]) -> None:
        self.root = root
        self._staging = staging
        self._checkout = checkout
        self._mu = threading.Lock()  # guards `_entries` and every rename out of `root`
        self._entries: dict[str, _Entry] = {}

    def path(self, ck: str) -> Path:
        """Where layer `ck` is (or will be, once `ensure`d)."""
        return self.root / ck

    def counts(self) -> dict[str, int]:
        """References held per layer."""
        with self._mu:
            return {ck: e.count for ck, e in self._entries.items()}

    def acquire(self, ck: str) -> None:
        """One more reference to layer `ck` (no I/O: `ensure` puts its directory there)."""
        with self._mu:
            self._entries.setdefault(ck, _Entry()).count += 1

    def release(self, ck: str) -> None:
        """One reference fewer; the last one deletes the layer's directory."""
        with self._mu:
            e = self._entries.get(ck)
            if e is None or e.count <= 0:
                raise RuntimeError(f"layer {ck}: released more often than acquired")
            e.count -= 1
            if e.count:
                return
            del self._entries[ck]
            # Out of `root` under the lock: an acquire from here on finds no directory and checks it out.
            doomed = self._staging / f"{ck}-{new_id('gone')}"
            try:
                os.rename(self.path(ck), doomed)
            except FileNotFoundError:
                return  # never checked out (a record adopted after a crash, then killed)
        remove_tree(doomed)

    def update(self, before: Iterable[str], after: Iterable[str]) -> None:
        """A holder's references change from `before` to `after`: the new ones first, so that a
        layer in both never reaches zero."""
        old, new = set(before), set(after)
        for ck in new - old:
            self.acquire(ck)
        for ck in old - new:
            self.release(ck)

    def ensure(self, ck: str) -> Path:
        """Layer `ck`'s directory, checked out of the store unless there; the caller holds a reference."""
        e = self._held(ck)
        with e.fill:
            path = self.path(ck)
            if not path.exists():
                tmp = self._staging / f"{ck}-fs-{new_id('in')}"
                try:
                    self._checkout(ck, tmp)
                    os.rename(tmp, path)
                finally:
                    remove_tree(tmp)
        return path

    def adopt(self, ck: str, tree: Path) -> Path:
        """Move the sealed fs `tree` in as layer `ck` (unless the layer is there already: then `tree`
        is removed); the caller holds a reference."""
        e = self._held(ck)
        with e.fill:
            path = self.path(ck)
            if path.exists():
                remove_tree(tree)
            else:
                os.rename(tree, path)
        return path

    @contextlib.contextmanager
    def held(self, ck: str) -> Iterator[Path]:
        """Layer `ck` present and referenced for the block's length."""
        self.acquire(ck)
        try:
            yield self.ensure(ck)
        finally:
            self.release(ck)

    def sweep(self) -> list[str]:
        """Remove every layer directory nobody holds (at startup, after the counts are rebuilt: a crash
        may have left some). Returns the ids removed."""
        with self._mu:
            doomed = []
            for d in self.root.iterdir():
                if d.name not in self._entries:
                    gone = self._staging / f"{d.name}-{new_id('gone')}"
                    os.rename(d, gone)
                    doomed.append((d.name, gone))
        for _, gone in doomed:
            remove_tree(gone)
        return [name for name, _ in doomed]

    def _held(self, ck: str) -> _Entry:
        with self._mu:
            e = self._entries.get(ck)
        if e is None:
            raise RuntimeError(f"layer {ck}: used without a reference")
        return e
