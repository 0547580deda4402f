"""How files become chunks: the chunk size policy, BLAKE3 digests, and the page diff against a parent.

CRIU page images (`pages-<n>.img`) hold a process's memory page after page, so they are cut at
`PAGE` (4 KiB): dirtying a few pages changes only those chunks, and whole-page insertions keep the
others aligned. Every other file is cut at fixed `BLOCK` (64 KiB) offsets: CRIU's other images are a
few KiB (one chunk each) and an overlay upper layer changes by whole new files, appends and in-place
writes, which fixed offsets dedup as well as content-defined cuts would. Content-defined cuts pay
only for insertions into the middle of large files, and need a rolling hash over every byte: even
vectorised in numpy (a windowed sum of per-byte random values) that measured ~0.5 s per 64 MiB
here, against ~13 ms to BLAKE3 the same bytes in 64 KiB blocks.

A second checkpoint of a sandbox rewrites its whole memory image, almost all of it unchanged.
Hashing 16k pages one BLAKE3 call each costs ~2 us per page of interpreter overhead (~33 ms per 64
MiB); instead `unchanged_pages` compares the new image with the parent's pages where they lie in
the packs (numpy, memory speed, exact: equal bytes are equal chunks), and only pages that differ
are hashed.
"""

from __future__ import annotations

import queue
import re
from collections.abc import Callable, Iterator

import numpy as np
from blake3 import blake3

from k3sys.sandbox.errors import StoreInputError
from k3sys.sandbox.store.manifest import DIGEST
from k3sys.sandbox.store.pack import PAGE

BLOCK = 64 * 1024
# Files are read, hashed and packed this many bytes at a time (a multiple of BLOCK): small enough to
# pipeline (hash one window while the previous is written) and to keep a commit's memory bounded.
WINDOW = 4 << 20
_PAGES_IMG = re.compile(r"pages-\d+\.img")
_WORDS = PAGE // 8  # a page as uint64 words, for wide comparisons


def chunk_size_for(name: str) -> int:
    """Chunk size in bytes for a file called `name` (its last path component)."""
    return PAGE if _PAGES_IMG.fullmatch(name) else BLOCK


class BufferRing:
    """`n` reusable `[WINDOW]` uint8 read buffers, so a commit touches `n * WINDOW` bytes of fresh
    memory however large its files. `take` blocks until a buffer is free again."""

    def __init__(self, n: int = 3) -> None:
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(n):
            self._free.put(np.empty(WINDOW, np.uint8))

    def take(self) -> np.ndarray:
        return self._free.get()

    def give(self, buf: np.ndarray) -> None:
        self._free.put(buf)


def read_windows(path: str, size: int, ring: BufferRing) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """The file at `path` (`size` bytes) as (start offset, `[<= WINDOW]` uint8 data, its ring buffer).

    The caller gives each buffer back to `ring` once done with it. Reading (not mmap) keeps a file
    truncated under us from killing the process with SIGBUS; a size change is reported instead.
    """
    with open(path, "rb", buffering=0) as f:
        for start in range(0, size, WINDOW):
            buf = ring.take()
            data = buf[: min(WINDOW, size - start)]
            view, got = memoryview(data), 0
            while got < data.size and (n := f.readinto(view[got:])):
                got += n
            if got != data.size:
                ring.give(buf)
                break
            yield start, data, buf
        else:
            if not f.read(1):
                return
    raise StoreInputError(f"{path!r} changed size while being committed (expected {size} bytes)")


def digest_chunks(buf: np.ndarray, chunk_size: int, which: np.ndarray) -> list[bytes]:
    """BLAKE3 digests of the chunks numbered `which` (`[k]` int) of `buf` (`[size]` uint8)."""
    mv = memoryview(buf)
    return [blake3(mv[i * chunk_size : (i + 1) * chunk_size]).digest() for i in which.tolist()]


def unchanged_pages(
    buf: np.ndarray, pack: np.ndarray, offset: np.ndarray, pages_of: Callable[[int], np.ndarray]
) -> np.ndarray:
    """Which of the first `k` full pages of `buf` equal the parent's page at the same index, `[k]` bool.

    `pack`, `offset` (`[m]` int64): where the parent's pages lie (pack number, byte offset; pack -1
    or an unaligned offset mean "not comparable", e.g. a chunk first stored by a non-page file).
    `pages_of(p)` gives pack `p`'s data as `[slots, PAGE // 8]` uint64. `k = min(len(buf) // PAGE, m)`.
    """
    k = min(buf.size // PAGE, pack.size)
    same = np.zeros(k, bool)
    if k == 0:
        return same
    new = buf[: k * PAGE].view(np.uint64).reshape(k, _WORDS)
    pack, offset = pack[:k], offset[:k]
    usable = (pack >= 0) & (offset % PAGE == 0)
    slot = offset // PAGE
    # Most pages usually still lie where one earlier commit wrote the image in page order, i.e. share
    # one (pack, slot - index): compare that span in place, without copying.
    key = (pack << 40) + (slot - np.arange(k) + (1 << 39))
    if usable.any():
        keys, counts = np.unique(key[usable], return_counts=True)
        top = int(keys[counts.argmax()])
        hit = usable & (key == top)
        at = np.flatnonzero(hit)
        a, b, p = int(at[0]), int(at[-1]) + 1, top >> 40
        s = int(slot[a])
        same[a:b] = (new[a:b] == pages_of(p)[s : s + b - a]).all(axis=1) & hit[a:b]
        usable &= ~hit
    # The rest (pages rewritten by later commits, scattered over their packs): gather per pack.
    rest = np.flatnonzero(usable)
    for p in np.unique(pack[rest]).tolist():
        sel = rest[pack[rest] == p]
        same[sel] = (new[sel] == pages_of(p)[slot[sel]]).all(axis=1)
    return same


def as_rows(chunks: bytes) -> np.ndarray:
    """Concatenated digests as a `[n, DIGEST]` uint8 array (a view, no copy)."""
    return np.frombuffer(chunks, np.uint8).reshape(-1, DIGEST)


def split(chunks: bytes) -> list[bytes]:
    """Concatenated digests as a list of `DIGEST`-byte strings."""
    return np.frombuffer(chunks, f"V{DIGEST}").tolist()
