"""Letting go of what a sandbox holds on the host: its processes, mounts and cgroups (the driver),
its directories, staged images and own checkpoint, and its place in the table. Killing, a failed
create or restore, and a timeout's kill end here; a hibernation wipes only its upper layer."""

from __future__ import annotations

from k3sys.sandbox.runtime.catalog import Catalog
from k3sys.sandbox.runtime.drivers.base import Driver
from k3sys.sandbox.runtime.prefetch import Prefetcher
from k3sys.sandbox.runtime.state import Record, State
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.trees import remove_tree


class Reclaimer:
    """Releases the sandboxes of `table` (see the module docstring)."""

    def __init__(self, table: SandboxTable, driver: Driver, prefetcher: Prefetcher, catalog: Catalog) -> None:
        self.table = table
        self.driver = driver
        self.prefetcher = prefetcher
        self.catalog = catalog

    def discard(self, rec: Record) -> None:
        """Release everything of `rec` (its lock held) and forget it (its checkpoints stay in the store,
        but its own). A driver that cannot let go leaves it `lost` with the reason, and raises."""
        dirs = self.table.dirs(rec.id)
        self.driver.drop_agent(rec.id)  # calls waiting on it fail now; commands die with the sandbox
        try:
            self.driver.destroy(rec.id, dirs)
        except BaseException as e:
            # Something is still held (a mount, a cgroup): keep the record so it stays visible.
            self.table.set(rec, State.LOST, reason=f"kill failed: {e}")
            raise
        remove_tree(dirs.root)
        self.prefetcher.unstage(rec.id)
        self.table.drop(rec)
        self.catalog.drop_own(rec.hibernation)

    def wipe_upper(self, rec: Record) -> None:
        """Delete what a stopped sandbox wrote since its lower layer, and its bundle and logs."""
        dirs = self.table.dirs(rec.id)
        for d in (dirs.upper, dirs.work, dirs.bundle, dirs.logs):
            remove_tree(d)
