"""Pack files: the chunks one commit wrote, appended to one file with its own index at the end.

    chunk data | index: count x (digest 32 B, offset u64, length u32) | footer

footer = b"K3SYSPK1" | u64 index offset | u32 count | BLAKE3 of the index (32 B). A pack is
written under `tmp/`, fsynced once, then renamed into `packs/` (and the directory fsynced), so a
pack in `packs/` is always complete; its index makes the store's global index rebuildable. Page
chunks (`PAGE` bytes) start at `PAGE`-aligned offsets, so a pack's page data can be viewed as an
array of pages (see `chunker.changed_pages`).
"""

from __future__ import annotations

import contextlib
import os
import struct

from blake3 import blake3

from k3sys.sandbox.errors import CorruptStoreError

PAGE = 4096
MAGIC = b"K3SYSPK1"
_ROW = struct.Struct("<32sQI")
_FOOTER = struct.Struct("<8sQI32s")
_ZEROS = bytes(PAGE)

Buffer = bytes | bytearray | memoryview


def fsync_dir(path: str) -> None:
    """Make renames and unlinks inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


class PackWriter:
    """Appends chunks to a new pack under `tmp_path`; `finish` makes it durable at `final_path`."""

    def __init__(self, tmp_path: str, final_path: str) -> None:
        self.tmp_path, self.final_path = tmp_path, final_path
        self.fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.offset = 0
        self.rows: list[tuple[bytes, int, int]] = []  # (digest, offset, length)

    def add(self, digests: list[bytes], data: Buffer, chunk_size: int) -> list[int]:
        """Append the consecutive chunks `digests` held back to back in `data`; return their offsets."""
        size = memoryview(data).nbytes
        if chunk_size == PAGE and self.offset % PAGE:
            pad = PAGE - self.offset % PAGE
            write_all(self.fd, _ZEROS[:pad])
            self.offset += pad
        write_all(self.fd, data)
        offsets = list(range(self.offset, self.offset + size, chunk_size))
        for d, off in zip(digests, offsets, strict=True):
            self.rows.append((d, off, min(chunk_size, self.offset + size - off)))
        self.offset += size
        return offsets

    def finish(self) -> None:
        """Write the index and footer, fsync, and rename the pack into place (durably)."""
        index = b"".join(_ROW.pack(*r) for r in self.rows)
        write_all(self.fd, index + _FOOTER.pack(MAGIC, self.offset, len(self.rows), blake3(index).digest()))
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp_path, self.final_path)
        fsync_dir(os.path.dirname(self.final_path))

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp_path)


def read_index(path: str) -> tuple[list[tuple[bytes, int, int]], int]:
    """The (digest, offset, length) rows of the pack at `path` and the end of its chunk data."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < _FOOTER.size:
            raise CorruptStoreError(f"pack {path!r}: {size} bytes, too short for a footer")
        f.seek(size - _FOOTER.size)
        magic, index_at, count, check = _FOOTER.unpack(f.read(_FOOTER.size))
        if magic != MAGIC or index_at + count * _ROW.size + _FOOTER.size != size:
            raise CorruptStoreError(f"pack {path!r}: bad footer")
        f.seek(index_at)
        index = f.read(count * _ROW.size)
    if blake3(index).digest() != check:
        raise CorruptStoreError(f"pack {path!r}: index checksum mismatch")
    rows = list(_ROW.iter_unpack(index))
    if any(off + n > index_at for _, off, n in rows):
        raise CorruptStoreError(f"pack {path!r}: index points past the chunk data")
    return rows, index_at
