"""The content-addressed checkpoint store: commit trees as deduplicated chunks, check them out again.

Layout under `root`:

    LOCK                  fcntl lock file (see Concurrency)
    manifests/<id>.mf     one per checkpoint (`manifest.py`)
    packs/<name>.pack     the chunks one commit wrote, with their index (`pack.py`)
    tmp/                  files being written; anything left here is from a crash

Durability: a commit writes its new chunks to one pack (one fsync), renames it into `packs/` and
fsyncs the directory, then writes the manifest to `tmp/`, fsyncs it and links it into `manifests/`
(and fsyncs that directory). A manifest is therefore visible only once every chunk it names is
durable, and a crash at any point leaves earlier checkpoints intact and at worst a pack no manifest
references (or a temp file), which `gc()` removes and `verify()` reports. Nothing else is stored:
the chunk index (digest -> pack, offset) and the reference counts are rebuilt in memory from the
pack indexes and manifests when the store opens, so they can never disagree with the disk.

Concurrency: `fcntl.flock` on `LOCK`, taken on a fresh file descriptor per call, so it excludes
threads of one process as well as other processes: commit and checkout hold it shared; delete,
gc, compact and verify exclusive (they move, remove or judge data a commit in flight may rely on). The
in-memory index and counts are updated under a thread lock; hashing, comparing and file I/O run
outside it. Dictionary reads outside the lock are single, GIL-atomic lookups, and a chunk found
in the index cannot disappear while the shared lock is held. Another process's commits and deletes
are picked up by comparing directory listings at the start of every call.

Parts, each built with what it uses and owning its own state; `Store` wires them and delegates:

    Store ─┬─> Commits (commits.py)  commit, follow; the read buffers reused across commits
           ├─> Reads   (reads.py)    checkout, runs, open_pack (a FileReader reads through it)
           ├─> Upkeep  (upkeep.py)   gc, verify, compact, stats
           └─> Catalog (catalog.py)  get, list, delete; the lock, the manifests, chunk index and
                                     reference counts, and publishing a pack or a manifest durably
    Commits, Reads, Upkeep, transfer.py ──> Catalog (they read and change the store only through it)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from k3sys.sandbox.runtime.store.catalog import CRASH_ENV, Catalog
from k3sys.sandbox.runtime.store.commits import Commits
from k3sys.sandbox.runtime.store.follower import Follower
from k3sys.sandbox.runtime.store.manifest import Entry, Manifest
from k3sys.sandbox.runtime.store.reads import Reads, Run
from k3sys.sandbox.runtime.store.upkeep import Upkeep

__all__ = ["CRASH_ENV", "Store"]


class Store:
    """A checkpoint store rooted at `root` (created if missing). See the module docstring."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.catalog = Catalog(self.root)
        self.commits = Commits(self.catalog)
        self.reads = Reads(self.catalog)
        self.upkeep = Upkeep(self.catalog)

    def commit(
        self, trees: Mapping[str, Path | str], parent: str | None = None, meta: dict[str, Any] | None = None,
        id: str | None = None, follower: Follower | None = None,
    ) -> Manifest:
        """Snapshot each named directory tree (e.g. `{"criu": image_dir, "upper": upper_dir}`).

        Every chunk is hashed; chunks already stored are not written again, so a checkpoint after a
        small change writes little whatever its `parent` (recorded in the manifest). `meta` must be
        JSON-serialisable. `follower` (from `follow`, on one of the trees) brings the files it
        already packed; the commit takes it over, or aborts it if the commit fails. Returns the new
        checkpoint's manifest.
        """
        return self.commits.commit(trees, parent, meta, id, follower)

    def follow(self, directory: Path | str) -> Follower:
        """Start packing the CRIU page images that appear in `directory` while they are written
        (see `Follower`); hand the result to `commit(..., follower=...)` or `abort()` it."""
        return self.commits.follow(directory)

    def checkout(self, id: str, dests: Mapping[str, Path | str], holes: Callable[[str], bool] | None = None) -> None:
        """Rebuild each named tree of checkpoint `id` at `dests[name]` (created, or an empty directory).

        `dests` may name a subset of the checkpoint's trees. Files whose path `holes` accepts are made
        at their size with no data (their bytes to be read by range: reader.py). On failure nothing
        is left behind.
        """
        self.reads.checkout(id, dests, holes)

    def runs(self, e: Entry, where: str, first: int = 0, last: int | None = None) -> list[Run]:
        """Where chunks `first..last` of file entry `e` lie in the packs (`Reads.runs`)."""
        return self.reads.runs(e, where, first, last)

    def get(self, id: str) -> Manifest:
        """The manifest of checkpoint `id`."""
        return self.catalog.get(id)

    def list(self) -> list[Manifest]:
        """All checkpoints, oldest first."""
        return self.catalog.list()

    def delete(self, id: str) -> None:
        """Remove checkpoint `id`; chunks no other checkpoint references go, and packs left empty."""
        self.catalog.delete(id)

    def gc(self) -> dict[str, int]:
        """Remove what interrupted commits and deletes left: temp files and unreferenced packs."""
        return self.upkeep.gc()

    def verify(self) -> list[str]:
        """Re-hash every stored chunk and check every manifest; return the problems ([] if healthy).
        Holds the store's lock exclusively, so commits and checkouts wait until it is done."""
        return self.upkeep.verify()

    def compact(self, min_live: float = 0.5) -> dict[str, int]:
        """Rewrite the still-referenced chunks of packs less than `min_live` full into one new pack
        (`Upkeep.compact`). Returns counts and bytes freed."""
        return self.upkeep.compact(min_live)

    def stats(self) -> dict[str, int]:
        """Sizes in bytes and counts: on disk (packs + manifests), logical, unique chunk data."""
        return self.upkeep.stats()
