"""How files become chunks: the chunk size policy and BLAKE3 digests.

CRIU page images (`pages-<n>.img`) hold a process's memory page after page, so they are cut at
`PAGE` (4 KiB): dirtying a few pages changes only those chunks, and whole-page insertions keep the
others aligned. Every other file is cut at fixed `BLOCK` (64 KiB) offsets: CRIU's other images are a
few KiB (one chunk each) and an overlay upper layer changes by whole new files, appends and in-place
writes, which fixed offsets dedup as well as content-defined cuts would. Content-defined cuts pay
only for insertions into the middle of large files, and need a rolling hash over every byte: even
vectorised in numpy (a windowed sum of per-byte random values) that measured ~0.5 s per 64 MiB
here, against ~13 ms to BLAKE3 the same bytes in 64 KiB blocks.

A second checkpoint of a sandbox rewrites its whole memory image, almost all of it unchanged; every
page is hashed again (~2 us per page, ~30 ms per 64 MiB, mostly the cost of a BLAKE3 call) and only
the pages whose digest the store lacks are written. Comparing with the parent's pages instead is
cheaper only while those sit in the page cache; packs are written past it (`pack.py`), and reading
64 MiB back from this host's disk (~50 ms) costs more than hashing it.
"""

from __future__ import annotations

import functools
import mmap
import os
import queue
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from blake3 import blake3

from k3sys.sandbox.errors import StoreInputError
from k3sys.sandbox.runtime.store.manifest import DIGEST
from k3sys.sandbox.runtime.store.pack import PAGE

BLOCK = 64 * 1024
# Files are read, hashed and packed this many bytes at a time (a multiple of BLOCK): small enough to
# pipeline (hash one window while the previous is written) and to keep a commit's memory bounded.
WINDOW = 4 << 20
# Reads windows ahead for every commit of the process (see `read_windows`).
_READER = ThreadPoolExecutor(2, thread_name_prefix="k3sys-store-read")
_PAGES_IMG = re.compile(r"pages-\d+\.img")


def chunk_size_for(name: str) -> int:
    """Chunk size in bytes for a file called `name` (its last path component)."""
    return PAGE if _PAGES_IMG.fullmatch(name) else BLOCK


class BufferRing:
    """`n` reusable `[WINDOW]` uint8 read buffers, so a commit touches `n * WINDOW` bytes of fresh
    memory however large its files. `take` blocks until a buffer is free again. The buffers are
    page-aligned (anonymous mappings), so runs of pages in them can be written with O_DIRECT."""

    def __init__(self, n: int = 4) -> None:
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(n):
            self._free.put(np.frombuffer(mmap.mmap(-1, WINDOW), np.uint8))

    def take(self) -> np.ndarray:
        return self._free.get()

    def give(self, buf: np.ndarray) -> None:
        self._free.put(buf)


def read_windows(path: str, size: int, ring: BufferRing) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """The file at `path` (`size` bytes) as (start offset, `[<= WINDOW]` uint8 data, its ring buffer).

    The caller gives each buffer back to `ring` once done with it. From the second window on, each
    window is read on a helper thread while the caller works on the one before (the copy out of the
    page cache releases the GIL: ~10 ms per 64 MiB off the hashing thread). Reading (not mmap)
    keeps a file truncated under us from killing the process with SIGBUS; a size change is
    reported instead.
    """
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()

        def read(start: int) -> tuple[np.ndarray, np.ndarray] | None:
            buf = ring.take()
            data = buf[: min(WINDOW, size - start)]
            view, got = memoryview(data), 0
            while got < data.size and (n := os.preadv(fd, [view[got:]], start + got)):
                got += n
            if got != data.size:
                ring.give(buf)
                return None
            return data, buf

        ahead: Future | None = None
        try:
            for start in range(0, size, WINDOW):
                got = ahead.result() if ahead is not None else read(start)
                ahead = None
                if got is None:
                    break
                if start + WINDOW < size:
                    ahead = _READER.submit(read, start + WINDOW)
                yield start, *got
            else:
                if not os.pread(fd, 1, size):
                    return
        finally:
            if ahead is not None and (late := ahead.result()) is not None:  # the caller stopped early
                ring.give(late[1])
    raise StoreInputError(f"{path!r} changed size while being committed (expected {size} bytes)")


def digest_chunks(buf: np.ndarray, chunk_size: int) -> list[bytes]:
    """BLAKE3 digests of `buf` (`[size]` uint8) cut into `chunk_size` chunks (the last may be shorter).

    All-zero chunks (common in memory images) get the known zero digest without hashing: a look at
    each chunk's first word picks the candidates, so data without zeros costs nothing extra.
    """
    n, full = -(-buf.size // chunk_size), buf.size // chunk_size
    words = buf[: full * chunk_size].view(np.uint64).reshape(full, chunk_size // 8)
    zero = np.zeros(n, bool)
    maybe = np.flatnonzero(words[:, 0] == 0)
    zero[maybe] = ~words[maybe].any(axis=1)
    out = [zero_digest(chunk_size).tobytes()] * n
    # One hasher reset between chunks: constructing one per 4 KiB page is ~10% of the hashing time.
    h = blake3()
    update, digest, reset, mv = h.update, h.digest, h.reset, memoryview(buf)
    for i in np.flatnonzero(~zero).tolist():
        update(mv[i * chunk_size : (i + 1) * chunk_size])
        out[i] = digest()
        reset()
    return out


@functools.cache
def zero_digest(chunk_size: int) -> np.ndarray:
    """The digest of `chunk_size` zero bytes as `[DIGEST]` uint8 (such chunks are restored as holes)."""
    return np.frombuffer(blake3(bytes(chunk_size)).digest(), np.uint8)


def as_rows(chunks: bytes) -> np.ndarray:
    """Concatenated digests as a `[n, DIGEST]` uint8 array (a view, no copy)."""
    return np.frombuffer(chunks, np.uint8).reshape(-1, DIGEST)


def split(chunks: bytes) -> list[bytes]:
    """Concatenated digests as a list of `DIGEST`-byte strings."""
    return np.frombuffer(chunks, f"V{DIGEST}").tolist()
