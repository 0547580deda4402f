"""CRIU's process images as the runtime sees them (`RuncDriver.images`, the `ProcessImages` of
drivers/base.py): which files hold memory pages (the store checks those out as holes and the
driver reads them by range), how many bytes of pages a set holds, and the byte ranges a restore
reads before the sandbox runs (those CRIU restores itself; a hibernation has the store start
reading them)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from pathlib import Path

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime.drivers.base import Images
from k3sys.sandbox.runtime.drivers.lazypages import LazyPages
from k3sys.sandbox.runtime.drivers.pageserver import PageServer


def is_page_image(name: str) -> bool:
    """Whether CRIU image `name` holds memory pages."""
    return fnmatch.fnmatch(name, "pages-*.img")


def _no_read(name: str, offset: int, n: int) -> bytes:
    raise DriverError(f"{name}: no pages to read here")


class CriuImages:
    """CRIU's image layout, for the restores of `lazy` (the driver's lazy-pages daemons)."""

    def __init__(self, lazy: LazyPages) -> None:
        self.lazy = lazy

    def holds_memory(self, name: str) -> bool:
        return is_page_image(name)

    def memory_bytes(self, files: Iterable[tuple[str, int]]) -> int:
        return sum(size for name, size in files if is_page_image(name))

    def complete(self, path: Path) -> Images:
        return Images(path, self.memory_bytes((p.name, p.stat().st_size) for p in path.iterdir()))

    def first_reads(self, images: Path) -> dict[str, list[tuple[int, int]]]:
        # The pages CRIU restores itself (criu_ops `_stage` writes them): all of them for an eager restore.
        lazy = self.lazy.worth(self.complete(images).page_bytes)
        return PageServer(images, _no_read).eager(lazy)
