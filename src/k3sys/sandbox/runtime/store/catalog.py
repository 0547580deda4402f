"""`Catalog`: what a store holds, in memory and on disk, and the one protocol that changes it.

It owns the directories (`manifests/`, `packs/`, `tmp/`), the `LOCK` file (`flock`), the manifests,
the chunk index and the reference counts (rebuilt from disk by `refresh`, never stored), and the
durable publication of a pack and of a manifest. The store's other parts (commits.py, reads.py,
upkeep.py, transfer.py) are built on it and change the disk only through it. `mu` guards the
in-memory state; see store.py for the durability and concurrency rules.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from k3sys.sandbox.errors import CheckpointExistsError, CheckpointNotFoundError, CorruptStoreError, StoreInputError
from k3sys.sandbox.runtime.store.index import ChunkIndex
from k3sys.sandbox.runtime.store.manifest import Manifest, decode, encode
from k3sys.sandbox.runtime.store.pack import PackWriter, fsync_dir, read_index, write_all

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Test hook: name a point in a commit at which the process dies, as a crash would kill it.
CRASH_ENV = "K3SYS_STORE_CRASH_AT"


def crash_point(name: str) -> None:
    """Die here if `CRASH_ENV` names this point (tests of crash safety)."""
    if os.environ.get(CRASH_ENV) == name:
        os._exit(86)


def check_name(kind: str, value: str) -> None:
    """StoreInputError unless `value` is a valid checkpoint id or tree name."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise StoreInputError(f"{kind} {value!r} is not a valid name (letters, digits, '._-', at most 128)")


class Catalog:
    """The manifests, chunk index and reference counts of the store at `root` (directories created if
    missing), and the lock. Attributes read by the other parts hold `mu` where they say so."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mdir, self.pdir, self.tdir = (os.fspath(root / d) for d in ("manifests", "packs", "tmp"))
        for d in (self.mdir, self.pdir, self.tdir):
            os.makedirs(d, exist_ok=True)
        self.mu = threading.Lock()
        self.manifests: dict[str, Manifest] = {}
        self.broken: dict[str, str] = {}  # manifest or pack file name -> why it could not be read
        self.index = ChunkIndex(self.pdir)  # a chunk's length follows from its file entry
        self._pending: set[str] = set()  # pack file names this process is publishing right now
        # digest -> number of manifests that reference it. Counting is deferred (`_unsettled`) until
        # delete, gc, verify or stats need the counts, which keeps it off the checkpoint's path.
        self.refs: Counter[bytes] = Counter()
        self._unsettled: dict[str, Manifest] = {}
        with self.mu:
            self.refresh()

    @contextlib.contextmanager
    def flock(self, exclusive: bool) -> Iterator[None]:
        """The store's lock (`LOCK`), on a fresh descriptor: it excludes threads of this process too."""
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    # ---------------------------------------------------------------- checkpoints

    def get(self, id: str) -> Manifest:
        """The manifest of checkpoint `id`."""
        with self.mu:
            m = self.manifests.get(id)
            if m is None:
                self.refresh()
                m = self.manifests.get(id)
        if m is None:
            raise CheckpointNotFoundError(f"no checkpoint {id!r} in store {os.fspath(self.root)!r}")
        return m

    def list(self) -> list[Manifest]:
        """All checkpoints, oldest first."""
        with self.mu:
            self.refresh()
            return sorted(self.manifests.values(), key=lambda m: (m.created, m.id))

    def delete(self, id: str) -> None:
        """Remove checkpoint `id`; chunks no other checkpoint references go, and packs left empty."""
        with self.flock(exclusive=True), self.mu:
            self.refresh()
            m = self.manifests.get(id)
            if m is None:
                raise CheckpointNotFoundError(f"no checkpoint {id!r} in store {os.fspath(self.root)!r}")
            os.unlink(os.path.join(self.mdir, f"{id}.mf"))
            fsync_dir(self.mdir)
            self.settle()
            del self.manifests[id]
            dead = set()
            for d in m.digests():
                self.refs[d] -= 1
                if self.refs[d] <= 0:
                    del self.refs[d]
                    dead |= self.index.holders(d)
            self.collect(dead)

    # ---------------------------------------------------------------- publishing (durably, in order)

    def new_pack(self) -> tuple[str, PackWriter]:
        """A new pack's file name and its writer (written in `tmp/`, renamed into `packs/` by `finish`)."""
        # Names sort by creation time, so the oldest copy of a chunk is the indexed one.
        name = f"{time.time_ns():016x}-{secrets.token_hex(4)}.pack"
        return name, PackWriter(os.path.join(self.tdir, name), os.path.join(self.pdir, name))

    def publish_pack(self, writer: PackWriter, name: str) -> None:
        """Make the pack durable and index its chunks (after which other commits may dedup against it)."""
        with self.mu:
            self._pending.add(name)
        try:
            writer.finish()
            with self.mu:
                self.index.add(name, writer.rows, writer.offset, os.path.getsize(writer.final_path))
        finally:
            with self.mu:
                self._pending.discard(name)

    def temp_manifest(self, id: str) -> str:
        """A fresh path under `tmp/` for checkpoint `id`'s manifest before `publish_manifest`."""
        return os.path.join(self.tdir, f"{id}.{secrets.token_hex(4)}.mf")

    def publish_manifest(self, m: Manifest, tmp: str) -> None:
        """Write `m` durably to `tmp`, then link it into place (no-clobber: the id may have been taken).
        Every chunk it names must be durable already."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, encode(m))
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point("before-manifest")
        with self.mu:
            try:
                os.link(tmp, os.path.join(self.mdir, f"{m.id}.mf"))
            except FileExistsError as e:  # another process took the id after our check
                raise CheckpointExistsError(f"checkpoint {m.id!r} already exists") from e
            self._add_manifest(m)
        fsync_dir(self.mdir)

    # ---------------------------------------------------------------- bookkeeping (under `mu`)

    def settle(self) -> None:
        """Count the references of manifests added since the counts were last needed."""
        for m in self._unsettled.values():
            self.refs.update(m.digests())
        self._unsettled.clear()

    def collect(self, candidates: set[int]) -> int:
        """Delete those of the packs numbered `candidates` that hold the indexed copy of no referenced
        chunk; return the bytes freed. Needs the lock exclusive and the counts settled."""
        dead = [no for no in candidates if not any(d in self.refs for d, _, _ in self.index.indexed_rows(no))]
        freed = 0
        for no in dead:
            p = self.index.remove(no)
            os.unlink(p.path)
            freed += p.size
        if dead:
            fsync_dir(self.pdir)
        return freed

    def _add_manifest(self, m: Manifest) -> None:
        self.manifests[m.id] = m
        self._unsettled[m.id] = m

    def refresh(self) -> None:
        """Catch up with manifests and packs other processes added or removed since we last looked."""
        # Manifests first: a manifest we list has its pack in place before it, so listing packs after
        # it finds every chunk it names.
        m_names = {n[:-3] for n in os.listdir(self.mdir) if n.endswith(".mf")}
        p_names = {n for n in os.listdir(self.pdir) if n.endswith(".pack")} - self._pending
        known_m = set(self.manifests) | {n[:-3] for n in self.broken if n.endswith(".mf")}
        known_p = set(self.index.by_name) | {n for n in self.broken if n.endswith(".pack")}
        if m_names == known_m and p_names == known_p:
            return
        for name in known_p - p_names:
            self.broken.pop(name, None)
            if name in self.index.by_name:
                self.index.remove(self.index.by_name[name])
        for name in sorted(p_names - known_p):
            path = os.path.join(self.pdir, name)
            try:
                rows, data_end = read_index(path)
            except FileNotFoundError:  # removed by another process since we listed it
                continue
            except (CorruptStoreError, OSError) as e:
                self.broken[name] = str(e)
                continue
            self.index.add(name, rows, data_end, os.path.getsize(path))
        for id in known_m - m_names:
            self.broken.pop(f"{id}.mf", None)
            m = self.manifests.pop(id, None)
            if m is not None and self._unsettled.pop(id, None) is None:
                self.refs.subtract(m.digests())
                self.refs = +self.refs  # drop counts that reached zero
        for id in sorted(m_names - known_m):
            try:
                with open(os.path.join(self.mdir, f"{id}.mf"), "rb") as f:
                    m = decode(f.read(), f"manifests/{id}.mf")
            except FileNotFoundError:
                continue
            except (CorruptStoreError, OSError) as e:
                self.broken[f"{id}.mf"] = str(e)
                continue
            self._add_manifest(m)
