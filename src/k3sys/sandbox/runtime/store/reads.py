"""`Reads`: where the bytes of a checkpoint's file lie in the packs (`runs`: runs of chunks back to
back in one pack, and of zero chunks), copying them out, and `checkout`, which rebuilds whole trees
from them. A `FileReader` (reader.py) reads ranges through `runs` and `open_pack`. Built on a `Catalog`."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from k3sys.sandbox.errors import CorruptStoreError, StoreInputError
from k3sys.sandbox.runtime.store import chunker, tree
from k3sys.sandbox.runtime.store.catalog import Catalog
from k3sys.sandbox.runtime.store.manifest import Entry


class Run(NamedTuple):
    """Chunks of one file back to back in one pack (`Reads.runs`)."""

    pack: int  # the pack's number (unused where `zero`)
    offset: int  # the first byte in the pack
    at: int  # the first byte in the file
    size: int  # bytes
    zero: bool  # all-zero chunks, not read


class Reads:
    """Reads checkpoints out of `catalog` (see the module docstring); holds no state of its own."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def checkout(self, id: str, dests: Mapping[str, Path | str], holes: Callable[[str], bool] | None = None) -> None:
        """See `Store.checkout`."""
        cat = self.catalog
        with cat.flock(exclusive=False):
            with cat.mu:
                cat.refresh()  # packs another process removed must not be read from
            m = cat.get(id)
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
                        os.posix_fadvise(self.open_pack(r.pack, fds), r.offset, r.size, os.POSIX_FADV_WILLNEED)
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

    def runs(self, e: Entry, where: str, first: int = 0, last: int | None = None) -> list[Run]:
        """Where chunks `first..last` (default: all) of file entry `e` lie, as runs of chunks back to
        back in one pack, and of all-zero chunks (not read: a hole, or zeros); `where` names the
        file's checkpoint and tree in errors."""
        cat = self.catalog
        chunks = e.chunks[first * chunker.DIGEST : None if last is None else last * chunker.DIGEST]
        if len(chunks) == chunker.DIGEST and e.size < e.chunk_size:  # most images: one short chunk
            with cat.mu:
                (pack,), (off,) = cat.index.locate(chunks)
            if pack < 0:
                raise CorruptStoreError(f"checkpoint {where} file {e.path!r}: chunk {chunks.hex()} missing (1 of 1)")
            return [Run(int(pack), int(off), 0, e.size, False)]
        with cat.mu:
            pack, off = cat.index.locate(chunks)
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

    def open_pack(self, no: int, fds: dict[int, int]) -> int:
        """A descriptor of pack `no`, opened once into `fds` (the caller closes them; it must hold the
        store's lock, shared at least, so that the pack stays)."""
        fd = fds.get(no)
        if fd is None:
            with self.catalog.mu:
                fd = fds[no] = os.open(self.catalog.index.packs[no].path, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def _fill(self, fd: int, e: Entry, runs: list[Run], fds: dict[int, int], where: str) -> None:
        """Write file entry `e`'s bytes (its `runs`) to `fd`: one in-kernel copy per run of chunks
        adjacent in a pack. All-zero chunks become holes (a sparse file: no tmpfs memory, no copy),
        as in the source."""
        for r in runs:
            if r.zero:
                os.lseek(fd, r.size, os.SEEK_CUR)
                continue
            src, start, size = self.open_pack(r.pack, fds), r.offset, r.size
            while size:
                sent = os.sendfile(fd, src, start, size)
                if not sent:
                    raise CorruptStoreError(f"checkpoint {where} file {e.path!r}: a pack is truncated at {start}")
                start, size = start + sent, size - sent
        os.ftruncate(fd, e.size)  # a trailing hole has no bytes written to size the file
