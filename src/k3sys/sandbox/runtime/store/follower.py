"""`Follower`: packs CRIU's page images while CRIU still writes them (see the class), and `Packing`,
what one commit writes into. `Store.follow` makes one; `Commits.commit` takes its pack."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable

import numpy as np

from k3sys.sandbox.errors import StoreInputError
from k3sys.sandbox.runtime.store import chunker
from k3sys.sandbox.runtime.store.pack import PAGE, PackWriter

# What a follower needs of its store (`Commits._pack_window`): chunk, hash and pack one window of a
# file into the commit's pack, returning the chunks' digests. Passed in, so this module does not
# import commits.py (which imports it).
PackWindow = Callable[["Packing", np.ndarray, int], list[bytes]]


@dataclasses.dataclass(eq=False)
class Packing:
    """What one commit writes into: its new pack, its read buffers, the digests it packed so far,
    and the files a `Follower` already chunked (path -> (bytes, digests))."""

    name: str
    writer: PackWriter
    ring: chunker.BufferRing
    fresh: set[bytes] = dataclasses.field(default_factory=set)
    done: dict[str, tuple[int, list[bytes]]] = dataclasses.field(default_factory=dict)


class Follower:
    """Chunks and packs the CRIU page images (`pages-*.img`) of a directory while CRIU still writes
    them, so that the commit after the dump finds them done: hashing and writing overlap the dump
    instead of following it.

    Only for files their writer appends to, as CRIU does with page images: every byte below a
    file's current size is then final. A thread polls the directory (every `POLL` s) and takes
    whole pages, at least `MIN_READ` bytes at a time; `take()` (called by `Store.commit`) reads
    what is left once the writer is done. A file the commit finds replaced (another inode) or of
    another size is chunked again by the commit; bytes rewritten in place are not noticed, which
    is why nothing but append-only writers may be followed. Holds the store's lock shared (as a
    commit does) from the start, so `gc` cannot take the pack it writes. Until `take()` the thread
    (and the pack's writer thread it starts) runs at `NICE`: where cores are short, the writer
    (CRIU dumping a frozen sandbox) comes first.
    """

    POLL = 0.001
    MIN_READ = 1 << 20
    NICE = 5

    def __init__(self, lock: contextlib.AbstractContextManager, packing: Packing, pack_window: PackWindow,
                 directory: str) -> None:
        """`lock`: the store's lock, shared (entered here, left by `take` / `abort`); `packing`: the
        commit's pack; `pack_window`: see `PackWindow`."""
        self._pack_window, self._dir = pack_window, directory
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(lock)
        self._packing = packing
        self._files: dict[str, list] = {}  # path -> [(device, inode), bytes read, digests]
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._tid: int | None = None
        self._thread = threading.Thread(target=self._run, name="k3sys-store-follow", daemon=True)
        self._thread.start()

    def take(self) -> Packing:
        """Wait until the files are read to their end (their writer must be done) and hand over the pack."""
        self._finish()
        if self._error is not None:
            raise self._error
        self._packing.done = {path: (n, digests) for path, (ident, n, digests) in self._files.items()
                              if _identity(path) == ident}
        return self._packing

    def abort(self) -> None:
        """Stop and drop the pack (idempotent; a no-op on the pack once a commit published it)."""
        self._finish()
        self._packing.writer.abort()

    def _finish(self) -> None:
        self._stop.set()
        _unnice(self._tid)  # what is left is on the commit's path now
        self._thread.join()
        # The pack's writer thread, when this one started it, inherited its NICE: it writes the rest
        # of the commit, so it must not keep it.
        _unnice(self._packing.writer.thread_id)
        self._lock.close()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.NICE)
            self._tid = threading.get_native_id()
        try:
            while True:
                last = self._stop.is_set()  # looked at before reading: the last pass sees every byte
                with contextlib.suppress(FileNotFoundError):  # the dump has not made the directory yet
                    for name in os.listdir(self._dir):
                        path = os.path.join(self._dir, name)
                        if path not in self._files and chunker.chunk_size_for(name) == PAGE:
                            self._files[path] = [None, 0, []]
                for path, f in self._files.items():
                    self._read(path, f, last)
                if last:
                    return
                self._stop.wait(self.POLL)
        except BaseException as e:  # noqa: BLE001 - raised again by take()
            self._error = e

    def _read(self, path: str, f: list, last: bool) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # gone again: the commit will not find it either
        try:
            st = os.fstat(fd)
            if f[0] is None:
                f[0] = (st.st_dev, st.st_ino)
            if f[0] == (st.st_dev, st.st_ino):
                f[1] = self._append(path, fd, st.st_size, f[1], f[2], last)
        finally:
            os.close(fd)

    def _append(self, path: str, fd: int, size: int, done: int, digests: list[bytes], last: bool) -> int:
        """Pack the pages of `fd` from byte `done` on; returns how far it got."""
        p = self._packing
        while (n := size - done if last else (size - done) // PAGE * PAGE) >= (1 if last else self.MIN_READ):
            buf = p.ring.take()
            data = buf[: min(n, chunker.WINDOW)]
            view, got = memoryview(data), 0
            while got < data.size and (k := os.preadv(fd, [view[got:]], done + got)):
                got += k
            if got != data.size:
                p.ring.give(buf)
                raise StoreInputError(f"{path!r} shrank while being written")
            digests += self._pack_window(p, data, PAGE)
            p.writer.then(p.ring.give, buf)
            done += data.size
        return done


def _unnice(tid: int | None) -> None:
    """Back to the default priority for kernel thread `tid` (if any)."""
    if tid is not None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 0)


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of `path`, None if it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
