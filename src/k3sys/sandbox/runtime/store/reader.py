"""Ranges of a checkpoint's files read straight from the store's packs, without a checkout.

A lazy resume needs only a few of its memory pages before the sandbox runs; the rest are read from
here as CRIU's lazy-pages daemon asks for them (drivers/pageserver.py), so a resume copies nothing
into tmpfs first, and a pack the hibernate left in the page cache is read from memory.

A reader holds the store's lock shared for its whole life (as a checkout does for its length), so
no delete, gc or compaction removes a pack it may still read; those wait for `close`, which comes
once the sandbox's memory is all back (seconds). Chunks are located as they are asked for, so
opening a reader costs nothing whatever the memory's size.
"""

from __future__ import annotations

import fcntl
import os
import threading

import numpy as np

from k3sys.sandbox.errors import CorruptStoreError, StoreInputError
from k3sys.sandbox.runtime.store import chunker
from k3sys.sandbox.runtime.store.store import Store


class FileReader:
    """The regular files of tree `tree` of checkpoint `ck`, readable by range until `close`."""

    def __init__(self, store: Store, ck: str, tree: str) -> None:
        self.ck, self._store = ck, store
        self._files = {e.path: e for e in store.get(ck).trees[tree] if e.kind == "file" and e.size}
        self._fds: dict[int, int] = {}  # pack number -> descriptor
        self._mu = threading.Lock()
        self._lock = os.open(store.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_SH)  # as Store._flock(exclusive=False), held until `close`
        except BaseException:
            os.close(self._lock)
            raise

    def sizes(self) -> list[tuple[str, int]]:
        """(path, bytes) of every non-empty file."""
        return [(path, e.size) for path, e in self._files.items()]

    def read(self, path: str, offset: int, n: int) -> bytearray:
        """`n` bytes of file `path` from `offset` (all-zero chunks as zeros); the range must lie
        inside the file (StoreInputError naming it otherwise)."""
        e = self._files.get(path)
        size = e.size if e is not None else 0
        if e is None or n < 0 or offset < 0 or offset + n > size:
            raise StoreInputError(f"checkpoint {self.ck!r}: bytes {offset}..{offset + n} of {path!r} "
                                  f"lie outside its {size} bytes")
        out = bytearray(n)
        view, cs = memoryview(out), e.chunk_size
        first, last = offset // cs, -(-(offset + n) // cs)
        digests = e.chunks[first * chunker.DIGEST : last * chunker.DIGEST]
        z = (chunker.as_rows(digests) == chunker.zero_digest(cs)).all(axis=1)
        with self._mu:  # `close` must not pull a descriptor from under a read
            if self._lock < 0:
                raise StoreInputError(f"checkpoint {self.ck!r}: the reader is closed")
            with self._store._mu:
                p, o = self._store._index.locate(digests)
                if (p < 0).any():
                    raise CorruptStoreError(f"checkpoint {self.ck!r} file {path!r}: a chunk is missing")
                for no in set(p.tolist()) - self._fds.keys():
                    self._fds[no] = os.open(self._store._index.packs[no].path, os.O_RDONLY | os.O_CLOEXEC)
            # One read per run of chunks back to back in one pack; runs of zero chunks stay zeros.
            cut = np.flatnonzero((p[1:] != p[:-1]) | (o[1:] != o[:-1] + cs) | (z[1:] != z[:-1])) + 1
            for s, end in zip(np.r_[0, cut].tolist(), np.r_[cut, len(p)].tolist(), strict=True):
                if z[s]:
                    continue
                start = (first + s) * cs  # the run's first byte in the file
                a, b = max(start, offset), min((first + end) * cs, offset + n)
                got = os.preadv(self._fds[int(p[s])], [view[a - offset : b - offset]], int(o[s]) + a - start)
                if got != b - a:
                    raise CorruptStoreError(f"checkpoint {self.ck!r}: a pack is truncated at {int(o[s])}")
        return out

    def close(self) -> None:
        """Let go of the packs and the store's lock (reads after this fail). Idempotent."""
        with self._mu:
            fds, self._fds = self._fds, {}
            lock, self._lock = self._lock, -1
        for fd in fds.values():
            os.close(fd)
        if lock >= 0:
            os.close(lock)  # releases the shared lock
