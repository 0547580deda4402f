"""Pack files: the chunks one commit wrote, appended to one file with its own index at the end.

    chunk data | index: count x (digest 32 B, offset u64, length u32) | footer

footer = b"K3SYSPK1" | u64 index offset | u32 count | BLAKE3 of the index (32 B). A pack is
written under `tmp/`, fsynced once, then renamed into `packs/` (and the directory fsynced), so a
pack in `packs/` is always complete; its index makes the store's global index rebuildable. Page
chunks (`PAGE` bytes) start at `PAGE`-aligned offsets, so runs of them are written, and read back
at checkout, with O_DIRECT.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from blake3 import blake3

from k3sys.sandbox.errors import CorruptStoreError

PAGE = 4096
MAGIC = b"K3SYSPK1"
_ROW = struct.Struct("<32sQI")
_ROW_ARRAY = np.dtype([("digest", "S32"), ("offset", "<u8"), ("length", "<u4")])  # _ROW, for whole runs
_FOOTER = struct.Struct("<8sQI32s")
_ZEROS = bytes(PAGE)
_IOV_MAX = os.sysconf("SC_IOV_MAX")

Buffer = Any  # bytes-like: bytes, memoryview, numpy array


def fsync_dir(path: str) -> None:
    """Make renames and unlinks inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, *data: Buffer) -> None:
    """Write every buffer of `data`, in order, with as few syscalls as `writev` allows."""
    views = [v for v in (memoryview(d).cast("B") for d in data) if v.nbytes]
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        while n:  # drop what was written; a partial write leaves the rest of a view
            if n >= views[0].nbytes:
                n -= views.pop(0).nbytes
            else:
                views[0], n = views[0][n:], 0


class PackWriter:
    """Appends chunks to a new pack under `tmp_path`; `finish` makes it durable at `final_path`.

    `add` only queues a chunk run; `flush` writes what is queued, and `then(fn, x)` also calls
    `fn(x)` once it is written (to recycle the buffer the runs came from). Small batches are written
    right away; from the first batch of `ASYNC_BYTES` on (a large new file) the writes move to a
    background thread, so hashing the next window overlaps writing this one.

    The pack is written with O_DIRECT where the file system allows it: straight from the caller's
    buffers to the disk, one copy, no page cache. On this host filling fresh page cache costs
    ~160 ms per 64 MiB (the hypervisor backs free memory lazily) against ~25 ms for the direct
    write, and the final fsync finds nothing left to flush. O_DIRECT needs `PAGE`-aligned memory,
    offsets and lengths: runs that are (page chunks from page-aligned buffers) go out as they are,
    anything else through a small aligned staging buffer; the pad after the footer is cut off by
    `ftruncate` before the fsync. Where O_DIRECT is refused the same writes go through the page cache.
    """

    ASYNC_BYTES = 1 << 20
    STAGE = 1 << 20

    def __init__(self, tmp_path: str, final_path: str) -> None:
        self.tmp_path, self.final_path = tmp_path, final_path
        self.fd = _open_direct(tmp_path)
        self.offset = 0
        self.rows: list[tuple[bytes, int, int]] = []  # (digest, offset, length)
        self.chunk_bytes = 0  # bytes of chunk data added (the offset less padding)
        self._index: list[bytes] = []  # `rows` packed as the pack's index, run by run
        self._stage = mmap.mmap(-1, self.STAGE)  # page-aligned (anonymous mappings are)
        self._staged = 0  # bytes in the stage, which starts at file offset `_written`
        self._written = 0  # bytes on disk: a multiple of PAGE until `finish`
        self._batch: list[Buffer] = []
        self._batch_bytes = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._aborted = False

    def add(self, digests: list[bytes], data: Buffer, chunk_size: int) -> None:
        """Queue the consecutive chunks `digests`, held back to back in `data` (left unchanged until
        a following `then` calls back), as chunks of `chunk_size` bytes (the last may be shorter)."""
        if self._error is not None:
            raise self._error
        size = memoryview(data).nbytes
        if chunk_size == PAGE and self.offset % PAGE:
            pad = PAGE - self.offset % PAGE
            self._batch.append(_ZEROS[:pad])
            self.offset += pad
        self._batch.append(data)
        self._batch_bytes += size
        self.chunk_bytes += size
        end = self.offset + size
        if len(digests) != -(-size // chunk_size):
            raise ValueError(f"{len(digests)} digests for {size} bytes in chunks of {chunk_size}")
        self.rows += zip(digests, range(self.offset, end, chunk_size), itertools.repeat(chunk_size))
        run = np.empty(len(digests), _ROW_ARRAY)
        run["digest"] = np.frombuffer(b"".join(digests), "S32")
        run["offset"] = np.arange(self.offset, end, chunk_size)
        run["length"] = chunk_size
        if size % chunk_size:
            d, off, _ = self.rows[-1]
            self.rows[-1] = (d, off, size % chunk_size)
            run["length"][-1] = size % chunk_size
        self._index.append(run.tobytes())
        self.offset = end

    def then(self, fn: Callable[[Any], object], arg: Any) -> None:
        """Write the queued chunks, then call `fn(arg)` (on the writer thread, if one is running)."""
        self.flush()
        if self._thread is None:
            fn(arg)
        else:
            self._queue.put((fn, arg))

    def finish(self) -> None:
        """Write the rest, the index and footer, fsync, and rename the pack into place (durably)."""
        self.flush()
        self._drain()
        if self._error is not None:
            raise self._error
        index = b"".join(self._index)
        self._append(index)
        self._append(_FOOTER.pack(MAGIC, self.offset, len(self.rows), blake3(index).digest()))
        size = self._written + self._staged
        self._write_stage(-(-self._staged // PAGE) * PAGE)  # whole pages; the pad is cut off below
        os.ftruncate(self.fd, size)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp_path, self.final_path)
        fsync_dir(os.path.dirname(self.final_path))

    def abort(self) -> None:
        """Stop writing and remove the temp file (a no-op after `finish`)."""
        self._aborted = True
        self._batch.clear()
        self._drain()
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping until it dies
            self._stage.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp_path)

    def flush(self) -> None:
        """Write (or hand to the writer thread) the chunks queued so far."""
        batch, self._batch, n, self._batch_bytes = self._batch, [], self._batch_bytes, 0
        if not batch:
            return
        if self._thread is None and n < self.ASYNC_BYTES:
            self._write_batch(batch)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="k3sys-pack-writer", daemon=True)
            self._thread.start()
        self._queue.put(batch)

    @property
    def thread_id(self) -> int | None:
        """The writer thread's kernel thread id (None while this thread writes itself)."""
        return self._thread.native_id if self._thread is not None else None

    def _drain(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, tuple):  # a `then` callback: always run, so no buffer is ever lost
                item[0](item[1])
            elif self._error is None and not self._aborted:
                try:
                    self._write_batch(item)
                except BaseException as e:  # noqa: BLE001 - handed to the committing thread by add/finish
                    self._error = e

    # Only one thread at a time writes (this one until the writer thread starts, then that one), so
    # the staging state below needs no lock.

    def _write_batch(self, batch: list[Buffer]) -> None:
        for data in batch:
            self._append(data)

    def _append(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        if self._staged % PAGE == 0 and view.nbytes % PAGE == 0 and _address(view) % PAGE == 0:
            self._write_stage(self._staged)
            self._write(view)
            self._written += view.nbytes
            return
        while view.nbytes:
            n = min(view.nbytes, self.STAGE - self._staged)
            self._stage[self._staged : self._staged + n] = view[:n]
            self._staged += n
            view = view[n:]
            if self._staged == self.STAGE:
                self._write_stage(self.STAGE)

    def _write_stage(self, n: int) -> None:
        """Write the first `n` staged bytes (a multiple of PAGE; zeros past `_staged`), keep the rest."""
        if not n:
            return
        self._stage[self._staged : n] = bytes(n - self._staged) if n > self._staged else b""
        self._write(memoryview(self._stage)[:n])
        rest = max(0, self._staged - n)
        self._stage[:rest] = self._stage[n : n + rest]
        self._written += n
        self._staged = rest

    def _write(self, view: memoryview) -> None:
        try:
            write_all(self.fd, view)
        except OSError as e:
            # Some file systems take O_DIRECT at open and refuse it on write: go through the cache.
            if e.errno != errno.EINVAL or not fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.lseek(self.fd, self._written, os.SEEK_SET)
            write_all(self.fd, view)


def _open_direct(path: str) -> int:
    """Create `path` for writing, with O_DIRECT unless the file system refuses it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # some file systems create the file before refusing the flag
    return os.open(path, flags, 0o644)


def _address(view: memoryview) -> int:
    """The memory address of `view`'s first byte."""
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0


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
