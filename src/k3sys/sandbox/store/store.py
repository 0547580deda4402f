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
import json
import mmap
import os
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from k3sys.sandbox.errors import CheckpointExistsError, CheckpointNotFoundError, CorruptStoreError, StoreInputError
from k3sys.sandbox.store import chunker, tree
from k3sys.sandbox.store.manifest import DIGEST, Entry, Manifest, decode, encode
from k3sys.sandbox.store.pack import PAGE, PackWriter, fsync_dir, read_index, write_all

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NOWHERE = -1
_OFFSET_BITS = 40  # the index packs (pack number, offset) into one int: offsets below 1 TiB
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
# Test hook: name a point in `commit` at which the process dies, as a crash would kill it.
CRASH_ENV = "K3SYS_STORE_CRASH_AT"


def _crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os._exit(86)


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise StoreInputError(f"{kind} {value!r} is not a valid name (letters, digits, '._-', at most 128)")


@dataclasses.dataclass(slots=True)
class _Pack:
    """A pack file known to the index: its chunk rows and, once needed, a read-only mapping."""

    name: str
    path: str
    rows: list[tuple[bytes, int, int]]
    data_end: int
    size: int
    map: mmap.mmap | None = None

    def pages(self) -> np.ndarray:
        """The chunk data as `[slots, PAGE // 8]` uint64 (page chunks sit at PAGE-aligned offsets)."""
        if self.map is None:
            with open(self.path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        n = self.data_end // PAGE
        return np.frombuffer(self.map, np.uint64, count=n * (PAGE // 8)).reshape(n, PAGE // 8)

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view still alive keeps the mapping until it dies
                self.map.close()
            self.map = None


class Store:
    """A checkpoint store rooted at `root` (created if missing). See the module docstring."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._mdir, self._pdir, self._tdir = (os.fspath(self.root / d) for d in ("manifests", "packs", "tmp"))
        for d in (self._mdir, self._pdir, self._tdir):
            os.makedirs(d, exist_ok=True)
        self._mu = threading.Lock()
        self._manifests: dict[str, Manifest] = {}
        self._broken: dict[str, str] = {}  # manifest or pack file name -> why it could not be read
        self._packs: dict[int, _Pack] = {}
        self._pack_no: dict[str, int] = {}  # pack file name -> number
        self._next_no = 0
        self._pending: set[str] = set()  # pack file names this process is publishing right now
        # digest -> pack number << _OFFSET_BITS | offset. A chunk's length follows from its file entry.
        # When several packs hold a chunk (concurrent commits wrote it twice), `_where` names the copy
        # in the pack whose name sorts first, so every process agrees on it, and `_dups` the others.
        self._where: dict[bytes, int] = {}
        self._dups: dict[bytes, list[int]] = {}
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
        id: str | None = None,
    ) -> Manifest:
        """Snapshot each named directory tree (e.g. `{"criu": image_dir, "upper": upper_dir}`).

        Chunks already stored are not written again; regular files whose path also exists in
        `parent` (if that checkpoint exists) are compared page by page against it first. `meta`
        must be JSON-serialisable. Returns the new checkpoint's manifest.
        """
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
                base = self._manifests.get(parent) if parent is not None else None
            scanned = {name: tree.scan(Path(path)) for name, path in trees.items()}
            pack_name, writer = self._new_pack()
            fresh: set[bytes] = set()  # digests written to this pack
            with self._mu:  # read buffers are reused across commits: fresh memory costs page faults
                ring = self._rings.pop() if self._rings else chunker.BufferRing()
            tmp_manifest = os.path.join(self._tdir, f"{id}.{secrets.token_hex(4)}.mf")
            try:
                out: dict[str, tuple[Entry, ...]] = {}
                for name, items in scanned.items():
                    olds = {e.path: e for e in base.trees.get(name, ())} if base else {}
                    out[name] = tuple(
                        self._chunk_file(e, path, olds.get(e.path), writer, ring, fresh) if e.kind == "file" else e
                        for e, path in items
                    )
                if writer.rows:
                    self._publish_pack(writer, pack_name)
                else:
                    writer.abort()
                with self._mu:  # every buffer is back (the writer has drained); a failed commit drops them
                    self._rings.append(ring)
                _crash_point("after-pack")
                m = Manifest(id, parent, time.time(), sum(e.size for es in out.values() for e in es),
                             sum(n for _, _, n in writer.rows), meta, out)
                self._publish_manifest(m, tmp_manifest)
                return m
            finally:
                writer.abort()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp_manifest)

    def checkout(self, id: str, dests: Mapping[str, Path | str]) -> None:
        """Rebuild each named tree of checkpoint `id` at `dests[name]` (created, or an empty directory).

        `dests` may name a subset of the checkpoint's trees. On failure nothing is left behind.
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
                for name, dest in dests.items():
                    dest = Path(dest)
                    done.append((dest, tree.prepare_dest(dest)))
                    tree.build(dest, m.trees[name], lambda fd, e, name=name: self._fill(fd, e, fds, f"{id}/{name}"))
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
                    dead.add(self._where.get(d, _NOWHERE) >> _OFFSET_BITS)
                    dead.update(loc >> _OFFSET_BITS for loc in self._dups.get(d, ()))
            self._collect(dead - {-1})

    def gc(self) -> dict[str, int]:
        """Remove what interrupted commits and deletes left: temp files and unreferenced packs."""
        with self._flock(exclusive=True), self._mu:
            self._refresh()
            temps = os.listdir(self._tdir)
            for name in temps:
                os.unlink(os.path.join(self._tdir, name))
            self._settle()
            before = len(self._packs)
            freed = self._collect(set(self._packs))
            return {"temp_files": len(temps), "packs": before - len(self._packs), "bytes": freed}

    def verify(self) -> list[str]:
        """Re-hash every stored chunk and check every manifest; return the problems ([] if healthy).

        Holds the store's lock exclusively, so commits and checkouts wait until it is done.
        """
        with self._flock(exclusive=True):
            with self._mu:
                self._refresh()
                self._settle()
                problems = [f"{name}: {why}" for name, why in sorted(self._broken.items())]
                manifests, packs = list(self._manifests.values()), dict(self._packs)
                where, refs = dict(self._where), self._refs.copy()
            problems += [f"leftover temp file tmp/{n} (an interrupted commit; gc() removes it)"
                         for n in sorted(os.listdir(self._tdir))]
            for m in sorted(manifests, key=lambda m: m.id):
                for name, entries in m.trees.items():
                    for e in entries:
                        missing = [d for d in chunker.split(e.chunks) if d not in where]
                        if missing:
                            problems.append(f"checkpoint {m.id!r} tree {name!r} file {e.path!r}: {len(missing)} "
                                            f"chunk(s) missing, first {missing[0].hex()}")
            # A pack whose chunks all have an older copy elsewhere (two commits wrote them at once) is
            # only wasted space, reclaimed by the next gc(); one that no checkpoint references is debris.
            for p in sorted(packs.values(), key=lambda p: p.name):
                label = f"pack {p.name}"
                if not any(d in refs for d, _, _ in p.rows):
                    problems.append(f"{label} holds no chunk any checkpoint references (left by an interrupted "
                                    "commit or delete; gc() removes it)")
                try:
                    with open(p.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                        bad = [(d, off) for d, off, n in p.rows if blake3(memoryview(mm)[off : off + n]).digest() != d]
                except OSError as e:
                    problems.append(f"{label}: cannot read ({e.strerror})")
                    continue
                problems += [f"{label} offset {off}: chunk {d.hex()} does not match its data" for d, off in bad]
            return problems

    def compact(self, min_live: float = 0.5) -> dict[str, int]:
        """Rewrite the still-referenced chunks of packs less than `min_live` full into one new pack.

        Deleting old checkpoints of a long chain leaves packs mostly dead but kept alive by a few
        pages; this bounds that waste. Holds the lock exclusively. Returns counts and bytes freed.
        """
        with self._flock(exclusive=True), self._mu:
            self._refresh()
            self._settle()
            refs, where = self._refs, self._where
            victims: dict[int, list[tuple[bytes, int, int]]] = {}
            for no, p in self._packs.items():
                live = [(d, off, n) for d, off, n in p.rows if d in refs and where[d] == no << _OFFSET_BITS | off]
                if live and sum(n for _, _, n in live) < min_live * p.data_end:
                    victims[no] = live
            if not victims:
                return {"packs": 0, "bytes": 0}
            name, writer = self._new_pack()
            try:
                for no, live in victims.items():
                    with open(self._packs[no].path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                        for d, off, n in live:
                            writer.add([d], mm[off : off + n], PAGE if n == PAGE else n)
                    writer.flush()  # one old pack's worth at a time: memory stays bounded
                writer.finish()
            finally:
                writer.abort()
            self._index_pack(name, writer.rows, writer.offset, os.path.getsize(writer.final_path))
            # The old copies sort first and stay indexed until their packs go; then the new ones take over.
            before = sum(self._packs[no].size for no in victims)
            for no in victims:
                os.unlink(self._unindex_pack(no).path)
            fsync_dir(self._pdir)
            return {"packs": len(victims), "bytes": before - os.path.getsize(writer.final_path)}

    def stats(self) -> dict[str, int]:
        """Sizes in bytes and counts: on disk (packs + manifests), logical, unique chunk data."""
        with self._mu:
            self._refresh()
            self._settle()
            manifest_bytes = sum(os.path.getsize(os.path.join(self._mdir, f"{i}.mf")) for i in self._manifests)
            where, refs = self._where, self._refs
            return {
                "bytes_on_disk": sum(p.size for p in self._packs.values()) + manifest_bytes,
                "bytes_logical": sum(m.bytes_total for m in self._manifests.values()),
                "bytes_unique": sum(n for no, p in self._packs.items() for d, off, n in p.rows
                                    if d in refs and where.get(d) == no << _OFFSET_BITS | off),
                "chunks": len(self._refs),
                "packs": len(self._packs),
                "manifests": len(self._manifests),
            }

    # ---------------------------------------------------------------- commit and checkout internals

    def _chunk_file(
        self, e: Entry, path: str, old: Entry | None, writer: PackWriter, ring: chunker.BufferRing, fresh: set[bytes]
    ) -> Entry:
        """`e` with its chunks: diffed against `old` (same path in the parent), hashed, new ones packed."""
        cs = chunker.chunk_size_for(e.path.rpartition("/")[2])
        rows = np.empty((-(-e.size // cs), DIGEST), np.uint8)
        base = old if old is not None and old.kind == "file" and old.chunk_size == cs == PAGE else None
        if base is not None:
            full = base.size // PAGE  # only the parent's full pages can be compared
            pack, offset = self._locate(base.chunks[: full * DIGEST])
            prev = chunker.as_rows(base.chunks)
        for start, data, buf in chunker.read_windows(path, e.size, ring):
            c0 = start // cs
            same = np.zeros(-(-data.size // cs), bool)
            if base is not None and c0 < full:
                hit = chunker.unchanged_pages(data, pack[c0:], offset[c0:], self._pages)
                same[: hit.size] = hit
                rows[c0 : c0 + hit.size][hit] = prev[c0 : c0 + hit.size][hit]
            todo = np.flatnonzero(~same)
            digests = chunker.digest_chunks(data, cs, todo)
            if digests:
                rows[c0 + todo] = np.frombuffer(b"".join(digests), np.uint8).reshape(-1, DIGEST)
            self._pack_new(data, cs, todo, digests, writer, fresh)
            writer.then(ring.give, buf)
        return dataclasses.replace(e, chunk_size=cs, chunks=rows.tobytes())

    def _pack_new(
        self, buf: np.ndarray, cs: int, todo: np.ndarray, digests: list[bytes], writer: PackWriter, fresh: set[bytes]
    ) -> None:
        """Append the chunks of `buf` numbered `todo` (digests given) that the store does not hold yet."""
        where = self._where
        run: list[bytes] = []
        first = last = -2
        for i, d in zip(todo.tolist(), digests, strict=True):
            if d in where or d in fresh:
                continue
            fresh.add(d)
            if i != last + 1 and run:  # the run of consecutive new chunks ends: write it in one go
                writer.add(run, buf[first * cs : (last + 1) * cs], cs)
                run = []
            if not run:
                first = i
            run.append(d)
            last = i
        if run:
            writer.add(run, buf[first * cs : (last + 1) * cs], cs)

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
                self._index_pack(name, writer.rows, writer.offset, os.path.getsize(writer.final_path))
        finally:
            with self._mu:
                self._pending.discard(name)

    def _locate(self, chunks: bytes) -> tuple[np.ndarray, np.ndarray]:
        """Where each digest of `chunks` is stored: `[n]` int64 pack numbers (-1: nowhere) and offsets."""
        get, digests = self._where.get, chunker.split(chunks)
        loc = np.fromiter((get(d, _NOWHERE) for d in digests), np.int64, count=len(digests))
        return loc >> _OFFSET_BITS, loc & _OFFSET_MASK

    def _pages(self, no: int) -> np.ndarray:
        with self._mu:
            return self._packs[no].pages()

    def _fill(self, fd: int, e: Entry, fds: dict[int, int], where: str) -> None:
        """Write file entry `e`'s bytes to `fd`: one in-kernel copy per run of chunks adjacent in a pack."""
        if not e.size:
            return
        pack, off = self._locate(e.chunks)
        lost = np.flatnonzero(pack < 0)
        if lost.size:
            raise CorruptStoreError(f"checkpoint {where} file {e.path!r}: chunk {e.digest(int(lost[0])).hex()} "
                                    f"missing ({lost.size} of {pack.size})")
        n = np.full(pack.size, e.chunk_size, np.int64)
        n[-1] = e.size - (pack.size - 1) * e.chunk_size
        # Runs of chunks that lie back to back in one pack are copied with one sendfile each.
        cut = np.flatnonzero((pack[1:] != pack[:-1]) | (off[1:] != off[:-1] + n[:-1])) + 1
        ends = np.r_[cut, pack.size]
        sizes = np.add.reduceat(n, np.r_[0, cut])
        for p, start, size in zip(pack[ends - 1].tolist(), off[np.r_[0, cut]].tolist(), sizes.tolist(), strict=True):
            src = fds.get(p)
            if src is None:
                with self._mu:
                    src = fds[p] = os.open(self._packs[p].path, os.O_RDONLY | os.O_CLOEXEC)
            while size:
                sent = os.sendfile(fd, src, start, size)
                if not sent:
                    raise CorruptStoreError(f"checkpoint {where} file {e.path!r}: a pack is truncated at {start}")
                start, size = start + sent, size - sent
        if os.lseek(fd, 0, os.SEEK_CUR) != e.size:
            raise CorruptStoreError(f"checkpoint {where} file {e.path!r}: rebuilt size differs from {e.size}")

    # ---------------------------------------------------------------- index bookkeeping (under self._mu)

    @contextlib.contextmanager
    def _flock(self, exclusive: bool) -> Iterator[None]:
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _index_pack(self, name: str, rows: list[tuple[bytes, int, int]], data_end: int, size: int) -> None:
        no = self._next_no
        self._next_no += 1
        self._packs[no] = _Pack(name, os.path.join(self._pdir, name), rows, data_end, size)
        self._pack_no[name] = no
        where, dups, base = self._where, self._dups, no << _OFFSET_BITS
        for d, off, _ in rows:
            loc, cur = base | off, where.get(d)
            if cur is None:
                where[d] = loc
                continue
            if name < self._packs[cur >> _OFFSET_BITS].name:
                loc, where[d] = cur, loc
            dups.setdefault(d, []).append(loc)

    def _unindex_pack(self, no: int) -> _Pack:
        """Forget pack `no`; chunks it held the indexed copy of fall back to their next copy, if any."""
        p = self._packs.pop(no)
        p.close()
        del self._pack_no[p.name]
        where, dups, base = self._where, self._dups, no << _OFFSET_BITS
        for d, off, _ in p.rows:
            loc, others = base | off, dups.get(d)
            if where.get(d) == loc:
                if others:
                    where[d] = min(others, key=lambda x: self._packs[x >> _OFFSET_BITS].name)
                    others.remove(where[d])
                else:
                    del where[d]
            elif others and loc in others:
                others.remove(loc)
            if others is not None and not others:
                del dups[d]
        return p

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
        known_p = set(self._pack_no) | {n for n in self._broken if n.endswith(".pack")}
        if m_names == known_m and p_names == known_p:
            return
        for name in known_p - p_names:
            self._broken.pop(name, None)
            if name in self._pack_no:
                self._unindex_pack(self._pack_no[name])
        for name in sorted(p_names - known_p):
            path = os.path.join(self._pdir, name)
            try:
                rows, data_end = read_index(path)
            except FileNotFoundError:  # removed by another process since we listed it
                continue
            except (CorruptStoreError, OSError) as e:
                self._broken[name] = str(e)
                continue
            self._index_pack(name, rows, data_end, os.path.getsize(path))
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

    def _collect(self, candidates: set[int]) -> int:
        """Delete those of the packs numbered `candidates` that hold the indexed copy of no referenced
        chunk; return the bytes freed."""
        refs, where = self._refs, self._where
        dead = [no for no in candidates if not any(
            refs.get(d) and where.get(d, _NOWHERE) >> _OFFSET_BITS == no for d, _, _ in self._packs[no].rows)]
        freed = 0
        for no in dead:
            p = self._unindex_pack(no)
            os.unlink(p.path)
            freed += p.size
        if dead:
            fsync_dir(self._pdir)
        return freed
