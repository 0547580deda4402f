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
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from k3sys.sandbox.errors import CheckpointExistsError, CheckpointNotFoundError, CorruptStoreError, StoreInputError
from k3sys.sandbox.runtime.store import chunker, tree
from k3sys.sandbox.runtime.store.follower import Follower, _Packing
from k3sys.sandbox.runtime.store.index import ChunkIndex
from k3sys.sandbox.runtime.store.manifest import Entry, Manifest, decode, encode
from k3sys.sandbox.runtime.store.pack import PackWriter, fsync_dir, read_index, write_all
from k3sys.sandbox.runtime.store.runs import Runs
from k3sys.sandbox.runtime.store.upkeep import Upkeep

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Test hook: name a point in `commit` at which the process dies, as a crash would kill it.
CRASH_ENV = "K3SYS_STORE_CRASH_AT"


def _crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os._exit(86)


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise StoreInputError(f"{kind} {value!r} is not a valid name (letters, digits, '._-', at most 128)")


class Store(Upkeep, Runs):
    """A checkpoint store rooted at `root` (created if missing). See the module docstring."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._mdir, self._pdir, self._tdir = (os.fspath(self.root / d) for d in ("manifests", "packs", "tmp"))
        for d in (self._mdir, self._pdir, self._tdir):
            os.makedirs(d, exist_ok=True)
        self._mu = threading.Lock()
        self._manifests: dict[str, Manifest] = {}
        self._broken: dict[str, str] = {}  # manifest or pack file name -> why it could not be read
        self._index = ChunkIndex(self._pdir)  # a chunk's length follows from its file entry
        self._pending: set[str] = set()  # pack file names this process is publishing right now
        # digest -> number of manifests that reference it. Counting is deferred (`_unsettled`) until
        # delete, gc, verify or stats need the counts, which keeps it off the checkpoint's path.
        self._refs: Counter[bytes] = Counter()
        self._unsettled: dict[str, Manifest] = {}
        self._rings: list[chunker.BufferRing] = []  # idle read buffers, one ring per concurrent commit
        with self._mu:
            self._refresh()

    # ---------------------------------------------------------------- public API

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
        try:
            return self._commit(trees, parent, meta, id, follower)
        finally:
            if follower is not None:
                follower.abort()  # a no-op once the commit took it over

    def follow(self, directory: Path | str) -> Follower:
        """Start packing the CRIU page images that appear in `directory` while they are written
        (see `Follower`); hand the result to `commit(..., follower=...)` or `abort()` it."""
        return Follower(self._flock(exclusive=False), self._packing(), self._pack_window, os.fspath(directory))

    def _commit(self, trees: Mapping[str, Path | str], parent: str | None, meta: dict[str, Any] | None,
                id: str | None, follower: Follower | None) -> Manifest:
        id = id if id is not None else secrets.token_hex(8)
        _check_name("checkpoint id", id)
        for name in trees:
            _check_name("tree name", name)
        meta = dict(meta or {})
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise StoreInputError(f"meta is not JSON-serialisable: {e}") from e
        with self._flock(exclusive=False):
            with self._mu:
                self._refresh()
                if id in self._manifests:
                    raise CheckpointExistsError(f"checkpoint {id!r} already exists")
            scanned = {name: tree.scan(Path(path)) for name, path in trees.items()}
            packing = follower.take() if follower is not None else self._packing()
            writer = packing.writer
            tmp_manifest = os.path.join(self._tdir, f"{id}.{secrets.token_hex(4)}.mf")
            try:
                out: dict[str, tuple[Entry, ...]] = {}
                for name, items in scanned.items():
                    out[name] = tuple(self._chunk_file(e, path, packing) if e.kind == "file" else e
                                      for e, path in items)
                if writer.rows:
                    self._publish_pack(writer, packing.name)
                else:
                    writer.abort()
                with self._mu:  # every buffer is back (the writer has drained); a failed commit drops them
                    self._rings.append(packing.ring)
                _crash_point("after-pack")
                m = Manifest(id, parent, time.time(), sum(e.size for es in out.values() for e in es),
                             writer.chunk_bytes, meta, out)
                self._publish_manifest(m, tmp_manifest)
                return m
            finally:
                writer.abort()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp_manifest)

    def checkout(self, id: str, dests: Mapping[str, Path | str], holes: Callable[[str], bool] | None = None) -> None:
        """Rebuild each named tree of checkpoint `id` at `dests[name]` (created, or an empty directory).

        `dests` may name a subset of the checkpoint's trees. Files whose path `holes` accepts are made
        at their size with no data (their bytes to be read by range: reader.py). On failure nothing
        is left behind.
        """
        with self._flock(exclusive=False):
            with self._mu:
                self._refresh()  # packs another process removed must not be read from
            m = self.get(id)
            unknown = sorted(set(dests) - set(m.trees))
            if unknown:
                raise StoreInputError(f"checkpoint {id!r} has no tree {unknown[0]!r} (it has {sorted(m.trees)})")
            done: list[tuple[Path, bool]] = []
            fds: dict[int, int] = {}
            try:
                # Where every file's bytes lie, and the reads of them all started at once (the packs
                # are written past the page cache: each read would otherwise wait for the disk in turn).
                plan = {(name, e.path): self.runs(e, f"{id}/{name}") for name in dests for e in m.trees[name]
                        if e.kind == "file" and e.size and not (holes is not None and holes(e.path))}
                for r in itertools.chain.from_iterable(plan.values()):
                    if not r.zero:
                        os.posix_fadvise(self._open_pack(r.pack, fds), r.offset, r.size, os.POSIX_FADV_WILLNEED)
                for name, dest in dests.items():
                    dest = Path(dest)
                    done.append((dest, tree.prepare_dest(dest)))

                    def write(fd: int, e: Entry, name: str = name) -> None:
                        runs = plan.get((name, e.path))
                        if runs is None:  # empty, or a hole to be read by range
                            os.ftruncate(fd, e.size)
                        else:
                            self._fill(fd, e, runs, fds, f"{id}/{name}")

                    tree.build(dest, m.trees[name], write)
            except BaseException:
                for dest, created in done:
                    tree.discard_dest(dest, created)
                raise
            finally:
                for fd in fds.values():
                    os.close(fd)

    def get(self, id: str) -> Manifest:
        """The manifest of checkpoint `id`."""
        with self._mu:
            m = self._manifests.get(id)
            if m is None:
                self._refresh()
                m = self._manifests.get(id)
        if m is None:
            raise CheckpointNotFoundError(f"no checkpoint {id!r} in store {os.fspath(self.root)!r}")
        return m

    def list(self) -> list[Manifest]:
        """All checkpoints, oldest first."""
        with self._mu:
            self._refresh()
            return sorted(self._manifests.values(), key=lambda m: (m.created, m.id))

    def delete(self, id: str) -> None:
        """Remove checkpoint `id`; chunks no other checkpoint references go, and packs left empty."""
        with self._flock(exclusive=True), self._mu:
            self._refresh()
            m = self._manifests.get(id)
            if m is None:
                raise CheckpointNotFoundError(f"no checkpoint {id!r} in store {os.fspath(self.root)!r}")
            os.unlink(os.path.join(self._mdir, f"{id}.mf"))
            fsync_dir(self._mdir)
            self._settle()
            del self._manifests[id]
            dead = set()
            for d in m.digests():
                self._refs[d] -= 1
                if self._refs[d] <= 0:
                    del self._refs[d]
                    dead |= self._index.holders(d)
            self._collect(dead)

    def _packing(self) -> _Packing:
        name, writer = self._new_pack()
        with self._mu:  # read buffers are reused across commits: fresh memory costs page faults
            ring = self._rings.pop() if self._rings else chunker.BufferRing()
        return _Packing(name, writer, ring)

    def _chunk_file(self, e: Entry, path: str, packing: _Packing) -> Entry:
        """`e` with its chunks: every chunk hashed, the ones the store lacks packed."""
        cs = chunker.chunk_size_for(e.path.rpartition("/")[2])
        size, digests = packing.done.get(path, (-1, []))
        if size != e.size:  # not packed by a follower (or changed since): read it now
            digests = []
            for _, data, buf in chunker.read_windows(path, e.size, packing.ring):
                digests += self._pack_window(packing, data, cs)
                packing.writer.then(packing.ring.give, buf)
        return dataclasses.replace(e, chunk_size=cs, chunks=b"".join(digests))

    def _pack_window(self, packing: _Packing, buf: np.ndarray, cs: int) -> list[bytes]:
        """The digests of `buf`'s chunks; appends those that neither the store nor this commit holds
        yet to the pack, each run of consecutive new chunks in one piece (`buf` must stay unchanged
        until a following `writer.then` calls back)."""
        digests = chunker.digest_chunks(buf, cs)
        # Set operations and `map` run the per-chunk loop in C (16k pages per 64 MiB).
        new_here = self._index.missing(set(digests)) - packing.fresh
        new = np.fromiter(map(new_here.__contains__, digests), bool, count=len(digests))
        if new.sum() > len(new_here):  # a new chunk repeats within the window: write its first copy only
            seen: set[bytes] = set()
            for i in np.flatnonzero(new).tolist():
                new[i] = digests[i] not in seen
                seen.add(digests[i])
        packing.fresh |= new_here
        edges = np.flatnonzero(np.diff(new, prepend=False, append=False)).tolist()
        for a, b in zip(edges[::2], edges[1::2], strict=True):
            packing.writer.add(digests[a:b], buf[a * cs : b * cs], cs)
        return digests

    def _new_pack(self) -> tuple[str, PackWriter]:
        # Names sort by creation time, so the oldest copy of a chunk is the indexed one.
        name = f"{time.time_ns():016x}-{secrets.token_hex(4)}.pack"
        return name, PackWriter(os.path.join(self._tdir, name), os.path.join(self._pdir, name))

    def _publish_manifest(self, m: Manifest, tmp: str) -> None:
        """Write `m` durably to `tmp`, then link it into place (no-clobber: the id may have been taken)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, encode(m))
            os.fsync(fd)
        finally:
            os.close(fd)
        _crash_point("before-manifest")
        with self._mu:
            try:
                os.link(tmp, os.path.join(self._mdir, f"{m.id}.mf"))
            except FileExistsError as e:  # another process took the id after our check
                raise CheckpointExistsError(f"checkpoint {m.id!r} already exists") from e
            self._add_manifest(m)
        fsync_dir(self._mdir)

    def _publish_pack(self, writer: PackWriter, name: str) -> None:
        """Make the pack durable and index its chunks (after which other commits may dedup against it)."""
        with self._mu:
            self._pending.add(name)
        try:
            writer.finish()
            with self._mu:
                self._index.add(name, writer.rows, writer.offset, os.path.getsize(writer.final_path))
        finally:
            with self._mu:
                self._pending.discard(name)

    # ---------------------------------------------------------------- index bookkeeping (under self._mu)

    @contextlib.contextmanager
    def _flock(self, exclusive: bool) -> Iterator[None]:
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _add_manifest(self, m: Manifest) -> None:
        self._manifests[m.id] = m
        self._unsettled[m.id] = m

    def _settle(self) -> None:
        """Count the references of manifests added since the counts were last needed."""
        for m in self._unsettled.values():
            self._refs.update(m.digests())
        self._unsettled.clear()

    def _refresh(self) -> None:
        """Catch up with manifests and packs other processes added or removed since we last looked."""
        # Manifests first: a manifest we list has its pack in place before it, so listing packs after
        # it finds every chunk it names.
        m_names = {n[:-3] for n in os.listdir(self._mdir) if n.endswith(".mf")}
        p_names = {n for n in os.listdir(self._pdir) if n.endswith(".pack")} - self._pending
        known_m = set(self._manifests) | {n[:-3] for n in self._broken if n.endswith(".mf")}
        known_p = set(self._index.by_name) | {n for n in self._broken if n.endswith(".pack")}
        if m_names == known_m and p_names == known_p:
            return
        for name in known_p - p_names:
            self._broken.pop(name, None)
            if name in self._index.by_name:
                self._index.remove(self._index.by_name[name])
        for name in sorted(p_names - known_p):
            path = os.path.join(self._pdir, name)
            try:
                rows, data_end = read_index(path)
            except FileNotFoundError:  # removed by another process since we listed it
                continue
            except (CorruptStoreError, OSError) as e:
                self._broken[name] = str(e)
                continue
            self._index.add(name, rows, data_end, os.path.getsize(path))
        for id in known_m - m_names:
            self._broken.pop(f"{id}.mf", None)
            m = self._manifests.pop(id, None)
            if m is not None and self._unsettled.pop(id, None) is None:
                self._refs.subtract(m.digests())
                self._refs = +self._refs  # drop counts that reached zero
        for id in sorted(m_names - known_m):
            try:
                with open(os.path.join(self._mdir, f"{id}.mf"), "rb") as f:
                    m = decode(f.read(), f"manifests/{id}.mf")
            except FileNotFoundError:
                continue
            except (CorruptStoreError, OSError) as e:
                self._broken[f"{id}.mf"] = str(e)
                continue
            self._add_manifest(m)
