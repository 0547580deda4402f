"""`Commits`: snapshot directory trees into the store as deduplicated chunks (`commit`), and start
packing CRIU's page images while CRIU still writes them (`follow`). Built on a `Catalog`, through
which every pack and manifest is published (see store.py for the order that keeps a crash safe)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from k3sys.sandbox.errors import CheckpointExistsError, StoreInputError
from k3sys.sandbox.runtime.store import chunker, tree
from k3sys.sandbox.runtime.store.catalog import Catalog, check_name, crash_point
from k3sys.sandbox.runtime.store.follower import Follower, Packing
from k3sys.sandbox.runtime.store.manifest import Entry, Manifest


class Commits:
    """Writes checkpoints into `catalog`; keeps the idle read buffers commits reuse."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._mu = threading.Lock()  # guards `_rings`
        self._rings: list[chunker.BufferRing] = []  # idle read buffers, one ring per concurrent commit

    def commit(
        self, trees: Mapping[str, Path | str], parent: str | None = None, meta: dict[str, Any] | None = None,
        id: str | None = None, follower: Follower | None = None,
    ) -> Manifest:
        """See `Store.commit`."""
        try:
            return self._commit(trees, parent, meta, id, follower)
        finally:
            if follower is not None:
                follower.abort()  # a no-op once the commit took it over

    def follow(self, directory: Path | str) -> Follower:
        """See `Store.follow`."""
        return Follower(self.catalog.flock(exclusive=False), self._packing(), self._pack_window,
                        os.fspath(directory))

    def _commit(self, trees: Mapping[str, Path | str], parent: str | None, meta: dict[str, Any] | None,
                id: str | None, follower: Follower | None) -> Manifest:
        cat = self.catalog
        id = id if id is not None else secrets.token_hex(8)
        check_name("checkpoint id", id)
        for name in trees:
            check_name("tree name", name)
        meta = dict(meta or {})
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise StoreInputError(f"meta is not JSON-serialisable: {e}") from e
        with cat.flock(exclusive=False):
            with cat.mu:
                cat.refresh()
                if id in cat.manifests:
                    raise CheckpointExistsError(f"checkpoint {id!r} already exists")
            scanned = {name: tree.scan(Path(path)) for name, path in trees.items()}
            packing = follower.take() if follower is not None else self._packing()
            writer = packing.writer
            tmp_manifest = cat.temp_manifest(id)
            try:
                out: dict[str, tuple[Entry, ...]] = {}
                for name, items in scanned.items():
                    out[name] = tuple(self._chunk_file(e, path, packing) if e.kind == "file" else e
                                      for e, path in items)
                if writer.rows:
                    cat.publish_pack(writer, packing.name)
                else:
                    writer.abort()
                with self._mu:  # every buffer is back (the writer has drained); a failed commit drops them
                    self._rings.append(packing.ring)
                crash_point("after-pack")
                m = Manifest(id, parent, time.time(), sum(e.size for es in out.values() for e in es),
                             writer.chunk_bytes, meta, out)
                cat.publish_manifest(m, tmp_manifest)
                return m
            finally:
                writer.abort()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp_manifest)

    def _packing(self) -> Packing:
        name, writer = self.catalog.new_pack()
        with self._mu:  # read buffers are reused across commits: fresh memory costs page faults
            ring = self._rings.pop() if self._rings else chunker.BufferRing()
        return Packing(name, writer, ring)

    def _chunk_file(self, e: Entry, path: str, packing: Packing) -> Entry:
        """`e` with its chunks: every chunk hashed, the ones the store lacks packed."""
        cs = chunker.chunk_size_for(e.path.rpartition("/")[2])
        size, digests = packing.done.get(path, (-1, []))
        if size != e.size:  # not packed by a follower (or changed since): read it now
            digests = []
            for _, data, buf in chunker.read_windows(path, e.size, packing.ring):
                digests += self._pack_window(packing, data, cs)
                packing.writer.then(packing.ring.give, buf)
        return dataclasses.replace(e, chunk_size=cs, chunks=b"".join(digests))

    def _pack_window(self, packing: Packing, buf: np.ndarray, cs: int) -> list[bytes]:
        """The digests of `buf`'s chunks; appends those that neither the store nor this commit holds
        yet to the pack, each run of consecutive new chunks in one piece (`buf` must stay unchanged
        until a following `writer.then` calls back)."""
        digests = chunker.digest_chunks(buf, cs)
        # Set operations and `map` run the per-chunk loop in C (16k pages per 64 MiB).
        new_here = self.catalog.index.missing(set(digests)) - packing.fresh
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
