"""Where the bytes of a checkpoint's file lie in the packs (`Runs.runs`: runs of chunks back to back
in one pack, and of zero chunks), and copying them out: what a checkout (store.py) and a
`FileReader` (reader.py) read through, mixed into `Store` and working on its index."""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from k3sys.sandbox.errors import CorruptStoreError
from k3sys.sandbox.runtime.store import chunker
from k3sys.sandbox.runtime.store.manifest import Entry


class Run(NamedTuple):
    """Chunks of one file back to back in one pack (`Store.runs`)."""

    pack: int  # the pack's number (unused where `zero`)
    offset: int  # the first byte in the pack
    at: int  # the first byte in the file
    size: int  # bytes
    zero: bool  # all-zero chunks, not read


class Runs:
    """`Store`'s reads (see the module docstring); `_mu` guards its `_index`."""

    def runs(self, e: Entry, where: str, first: int = 0, last: int | None = None) -> list[Run]:
        """Where chunks `first..last` (default: all) of file entry `e` lie, as runs of chunks back to
        back in one pack, and of all-zero chunks (not read: a hole, or zeros); `where` names the
        file's checkpoint and tree in errors."""
        chunks = e.chunks[first * chunker.DIGEST : None if last is None else last * chunker.DIGEST]
        if len(chunks) == chunker.DIGEST and e.size < e.chunk_size:  # most images: one short chunk
            with self._mu:
                (pack,), (off,) = self._index.locate(chunks)
            if pack < 0:
                raise CorruptStoreError(f"checkpoint {where} file {e.path!r}: chunk {chunks.hex()} missing (1 of 1)")
            return [Run(int(pack), int(off), 0, e.size, False)]
        with self._mu:
            pack, off = self._index.locate(chunks)
        lost = np.flatnonzero(pack < 0)
        if lost.size:
            raise CorruptStoreError(f"checkpoint {where} file {e.path!r}: chunk {e.digest(first + int(lost[0])).hex()} "
                                    f"missing ({lost.size} of {pack.size})")
        n = np.full(pack.size, e.chunk_size, np.int64)
        if last is None or last * e.chunk_size >= e.size:
            n[-1] = e.size - (first + pack.size - 1) * e.chunk_size
        zero = (chunker.as_rows(chunks) == chunker.zero_digest(e.chunk_size)).all(axis=1) & (n == e.chunk_size)
        cut = np.flatnonzero((pack[1:] != pack[:-1]) | (off[1:] != off[:-1] + n[:-1]) | (zero[1:] != zero[:-1])) + 1
        starts = np.r_[0, cut]
        at = first * e.chunk_size + np.r_[0, np.cumsum(n)[:-1]][starts]
        return [Run(*r) for r in zip(pack[starts].tolist(), off[starts].tolist(), at.tolist(),
                                     np.add.reduceat(n, starts).tolist(), zero[starts].tolist(), strict=True)]

    def _open_pack(self, no: int, fds: dict[int, int]) -> int:
        """A descriptor of pack `no`, opened once into `fds`."""
        fd = fds.get(no)
        if fd is None:
            with self._mu:
                fd = fds[no] = os.open(self._index.packs[no].path, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def _fill(self, fd: int, e: Entry, runs: list[Run], fds: dict[int, int], where: str) -> None:
        """Write file entry `e`'s bytes (its `runs`) to `fd`: one in-kernel copy per run of chunks
        adjacent in a pack. All-zero chunks become holes (a sparse file: no tmpfs memory, no copy),
        as in the source."""
        for r in runs:
            if r.zero:
                os.lseek(fd, r.size, os.SEEK_CUR)
                continue
            src, start, size = self._open_pack(r.pack, fds), r.offset, r.size
            while size:
                sent = os.sendfile(fd, src, start, size)
                if not sent:
                    raise CorruptStoreError(f"checkpoint {where} file {e.path!r}: a pack is truncated at {start}")
                start, size = start + sent, size - sent
        os.ftruncate(fd, e.size)  # a trailing hole has no bytes written to size the file

