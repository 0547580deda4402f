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

from k3sys.sandbox.errors import CorruptStoreError, StoreInputError
from k3sys.sandbox.runtime.store.store import Store


class FileReader:
    """The regular files of tree `tree` of checkpoint `ck`, readable by range until `close`."""

    def __init__(self, store: Store, ck: str, tree: str) -> None:
        self.ck, self._store, self._where = ck, store, f"{ck}/{tree}"
        self._files = {e.path: e for e in store.get(ck).trees[tree] if e.kind == "file" and e.size}
        self._fds: dict[int, int] = {}  # pack number -> descriptor
        self._planned: dict[tuple[str, int, int], list[tuple[int, int, int, int]]] = {}  # `prefetch`ed runs
        self._mu = threading.Lock()
        self._lock = os.open(store.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_SH)  # as Catalog.flock(exclusive=False), held until `close`
        except BaseException:
            os.close(self._lock)
            raise

    def sizes(self) -> list[tuple[str, int]]:
        """(path, bytes) of every non-empty file."""
        return [(path, e.size) for path, e in self._files.items()]

    def read(self, path: str, offset: int, n: int) -> bytearray:
        """`n` bytes of file `path` from `offset` (all-zero chunks as zeros); the range must lie
        inside the file (StoreInputError naming it otherwise)."""
        out = bytearray(n)
        view = memoryview(out)
        with self._mu:  # `close` must not pull a descriptor from under a read
            runs = self._planned.pop((path, offset, n), None)
            for fd, at, a, b in self._runs(path, offset, n) if runs is None else runs:
                got = os.preadv(fd, [view[a - offset : b - offset]], at)
                if got != b - a:
                    raise CorruptStoreError(f"checkpoint {self.ck!r}: a pack is truncated at {at}")
        return out

    def prefetch(self, path: str, ranges: list[tuple[int, int]]) -> None:
        """Have the kernel start reading the packs' bytes of `ranges` (offset, length) of file `path`
        (`read` them soon after: the reads of all the ranges overlap instead of taking turns)."""
        with self._mu:
            for offset, n in ranges:
                runs = self._planned[path, offset, n] = self._runs(path, offset, n)  # for that `read`
                for fd, at, a, b in runs:
                    os.posix_fadvise(fd, at, b - a, os.POSIX_FADV_WILLNEED)

    def _runs(self, path: str, offset: int, n: int) -> list[tuple[int, int, int, int]]:
        """Where bytes `offset..offset + n` of `path` lie: (pack descriptor, its offset, first and
        end byte in the file), one per run of chunks back to back in one pack (Store.runs); runs of
        zero chunks (zeros) are left out. Called with `_mu` held."""
        e = self._files.get(path)
        size = e.size if e is not None else 0
        if e is None or n < 0 or offset < 0 or offset + n > size:
            raise StoreInputError(f"checkpoint {self.ck!r}: bytes {offset}..{offset + n} of {path!r} "
                                  f"lie outside its {size} bytes")
        if self._lock < 0:
            raise StoreInputError(f"checkpoint {self.ck!r}: the reader is closed")
        if not n:
            return []
        cs = e.chunk_size
        out = []
        for r in self._store.reads.runs(e, self._where, offset // cs, -(-(offset + n) // cs)):
            a, b = max(r.at, offset), min(r.at + r.size, offset + n)
            if not r.zero and a < b:
                out.append((self._store.reads.open_pack(r.pack, self._fds), r.offset + a - r.at, a, b))
        return out

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the packs and the store's lock (reads after this fail). Idempotent."""
        with self._mu:
            fds, self._fds = self._fds, {}
            lock, self._lock = self._lock, -1
            self._planned.clear()
        for fd in fds.values():
            os.close(fd)
        if lock >= 0:
            os.close(lock)  # releases the shared lock
