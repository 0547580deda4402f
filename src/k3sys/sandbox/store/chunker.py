"""How files become chunks: the chunk size policy, BLAKE3 digests, and the page diff against a parent.

CRIU page images (`pages-<n>.img`) hold a process's memory page after page, so they are cut at
`PAGE` (4 KiB): dirtying a few pages changes only those chunks, and whole-page insertions keep the
others aligned. Every other file is cut at fixed `BLOCK` (64 KiB) offsets: CRIU's other images are a
few KiB (one chunk each) and an overlay upper layer changes by whole new files, appends and in-place
writes, which fixed offsets dedup as well as content-defined cuts would, without a rolling hash
over every byte (a Python-speed pass that would cost more than the BLAKE3 hashing itself).

A second checkpoint of a sandbox rewrites its whole memory image, almost all of it unchanged.
Hashing 16k pages one BLAKE3 call each costs ~2 us per page of interpreter overhead (~33 ms per 64
MiB); instead `unchanged_pages` compares the new image with the parent's pages where they lie in
the packs (numpy, memory speed, exact: equal bytes are equal chunks), and only pages that differ
are hashed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np
from blake3 import blake3

from k3sys.sandbox.errors import StoreInputError
from k3sys.sandbox.store.manifest import DIGEST
from k3sys.sandbox.store.pack import PAGE

BLOCK = 64 * 1024
WINDOW = 64 * 1024 * 1024  # files are read and chunked this many bytes at a time (a multiple of BLOCK)
_PAGES_IMG = re.compile(r"pages-\d+\.img")
_WORDS = PAGE // 8  # a page as uint64 words, for wide comparisons
# Runs of at least this many pages whose parent copies are contiguous in one pack are compared as
# slices (no copy); the rest are gathered per pack, so a fragmented parent costs at most one gather.
_MIN_RUN = 16


def chunk_size_for(name: str) -> int:
    """Chunk size in bytes for a file called `name` (its last path component)."""
    return PAGE if _PAGES_IMG.fullmatch(name) else BLOCK


def read_windows(path: str, size: int) -> Iterator[tuple[int, np.ndarray]]:
    """The file at `path` (`size` bytes) as (start offset, `[<= WINDOW]` uint8 array) pieces.

    Reading (not mmap) keeps a file truncated under us from killing the process with SIGBUS;
    a size change is reported instead.
    """
    with open(path, "rb", buffering=0) as f:
        for start in range(0, size, WINDOW):
            buf = np.empty(min(WINDOW, size - start), np.uint8)
            view, got = memoryview(buf), 0
            while got < buf.size and (n := f.readinto(view[got:])):
                got += n
            if got != buf.size:
                break
            yield start, buf
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

    `pack`, `offset` (`[m]` int64): where the parent's full pages lie (pack number, byte offset;
    pack -1 for "unknown", e.g. a chunk stored unaligned by a non-page file). `pages_of(p)` gives
    pack `p`'s data as `[slots, PAGE // 8]` uint64. `k = min(len(buf) // PAGE, m)`.
    """
    k = min(buf.size // PAGE, pack.size)
    same = np.zeros(k, bool)
    if k == 0:
        return same
    new = buf[: k * PAGE].view(np.uint64).reshape(k, _WORDS)
    pack, slot = pack[:k], offset[:k] // PAGE
    usable = (pack >= 0) & (offset[:k] % PAGE == 0)
    diag = slot - np.arange(k)
    cut = np.flatnonzero((pack[1:] != pack[:-1]) | (diag[1:] != diag[:-1]) | (usable[1:] != usable[:-1])) + 1
    starts, ends = np.r_[0, cut], np.r_[cut, k]
    long = (ends - starts >= _MIN_RUN) & usable[starts]
    for s, e in zip(starts[long].tolist(), ends[long].tolist(), strict=True):
        base = int(slot[s])
        same[s:e] = (new[s:e] == pages_of(int(pack[s]))[base : base + e - s]).all(axis=1)
    rest = np.flatnonzero(np.repeat(~long, ends - starts) & usable)
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
