"""The chunk index: which pack holds each stored chunk, rebuilt in memory from the packs' own indexes.

Several packs may hold one chunk when two commits wrote it at once. The indexed copy is then the one
in the pack whose name sorts first (names start with their creation time), so every process sharing
a store picks the same copy; the others are remembered as duplicates until their packs go. Not
thread-safe: the store calls the mutating methods under its lock.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from k3sys.sandbox.runtime.store import chunker

_OFFSET_BITS = 40  # a location packs (pack number, offset) into one int: offsets below 1 TiB
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_NOWHERE = -1

Row = tuple[bytes, int, int]  # (digest, offset, length) as a pack's own index lists them


@dataclasses.dataclass(slots=True)
class Pack:
    """A pack file known to the index."""

    name: str
    path: str
    rows: list[Row]
    data_end: int
    size: int


class ChunkIndex:
    """digest -> (pack number, offset) for every chunk in the packs of `pack_dir`."""

    def __init__(self, pack_dir: str) -> None:
        self.pack_dir = pack_dir
        self.packs: dict[int, Pack] = {}
        self.by_name: dict[str, int] = {}
        self._next = 0
        self._where: dict[bytes, int] = {}  # digest -> pack number << _OFFSET_BITS | offset
        self._dups: dict[bytes, list[int]] = {}  # digest -> locations of its other copies

    def __contains__(self, digest: bytes) -> bool:
        # A single dict lookup: safe without the store's lock (atomic under the GIL).
        return digest in self._where

    def missing(self, digests: set[bytes]) -> set[bytes]:
        """Those of `digests` no pack holds: one C-level pass over `digests` (not over the index),
        safe without the store's lock as a single call under the GIL."""
        return digests.difference(self._where)

    def add(self, name: str, rows: list[Row], data_end: int, size: int) -> int:
        """Index pack `name` (in `pack_dir`) and return its number."""
        no = self._next
        self._next += 1
        self.packs[no] = Pack(name, os.path.join(self.pack_dir, name), rows, data_end, size)
        self.by_name[name] = no
        where, base = self._where, no << _OFFSET_BITS
        fresh = {d: base | off for d, off, _ in rows}
        if len(self.missing(set(fresh))) == len(fresh):  # the usual case: no chunk is stored elsewhere
            where.update(fresh)
            return no
        for d, off, _ in rows:
            loc, cur = base | off, where.get(d)
            if cur is None:
                where[d] = loc
                continue
            if name < self.packs[cur >> _OFFSET_BITS].name:
                loc, where[d] = cur, loc
            self._dups.setdefault(d, []).append(loc)
        return no

    def remove(self, no: int) -> Pack:
        """Forget pack `no`; chunks it held the indexed copy of fall back to their next copy, if any."""
        p = self.packs.pop(no)
        del self.by_name[p.name]
        where, dups, base = self._where, self._dups, no << _OFFSET_BITS
        for d, off, _ in p.rows:
            loc, others = base | off, dups.get(d)
            if where.get(d) == loc:
                if others:
                    where[d] = min(others, key=lambda x: self.packs[x >> _OFFSET_BITS].name)
                    others.remove(where[d])
                else:
                    del where[d]
            elif others and loc in others:
                others.remove(loc)
            if others is not None and not others:
                del dups[d]
        return p

    def locate(self, chunks: bytes) -> tuple[np.ndarray, np.ndarray]:
        """Where each digest of `chunks` lies: `[n]` int64 pack numbers (-1: nowhere) and offsets."""
        get, digests = self._where.get, chunker.split(chunks)
        loc = np.fromiter((get(d, _NOWHERE) for d in digests), np.int64, count=len(digests))
        return loc >> _OFFSET_BITS, loc & _OFFSET_MASK

    def holders(self, digest: bytes) -> set[int]:
        """Numbers of every pack holding a copy of `digest`."""
        locs = [self._where.get(digest, _NOWHERE), *self._dups.get(digest, ())]
        return {loc >> _OFFSET_BITS for loc in locs} - {_NOWHERE}

    def indexed_rows(self, no: int) -> list[Row]:
        """The rows of pack `no` whose copy is the indexed one."""
        base, where = no << _OFFSET_BITS, self._where
        return [r for r in self.packs[no].rows if where.get(r[0]) == base | r[1]]
