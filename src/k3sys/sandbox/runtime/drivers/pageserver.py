"""Memory pages for a restore read by range from where they are kept (the store's packs), instead of
from CRIU page images checked out in full first.

The images directory then holds every image but the page images' data: those files have their size
and no bytes. Before the restore, `PageServer.fill` writes what CRIU itself reads: every page of an
eager restore, or, for a lazy one, the pages CRIU restores eagerly anyway (those its pagemaps do not
mark lazy). The lazy ones go to `criu lazy-pages` over CRIU's page-server protocol on a private
socket pair (`--page-server --ps-socket`): the daemon sends `PS_IOV_GET` (pid, address, pages) and
gets a header and the pages back, in order; `PS_IOV_CLOSE` gets a 0 status and ends it. A request
for memory the pagemaps do not hold lazily, or a read that fails, closes the socket: the daemon then
fails, and the sandbox is killed (lazypages.py), never left running on pages that did not come.

CRIU images are a 4-byte magic pair, then entries: u32 length, protobuf. A pagemap holds a head
(`pages_id`: the page image it indexes) and entries `vaddr, nr_pages, in_parent, flags`; the pages
of entries flagged PRESENT follow each other in the page image, in pagemap order.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import re
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from k3sys.sandbox.errors import DriverError

PAGE = 4096
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4  # pagemap entry flags (CRIU's pagemap.h)
PS_IOV_ADD_F, PS_IOV_GET, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 6, 7, 0x1023, 0x1024
_IOV = struct.Struct("<IIQQ")  # struct page_server_iov: cmd, nr_pages, vaddr, dst_id
_FILL = 8 << 20  # bytes read and written per step of `fill`
_MAX_REQUEST = (16 << 20) // PAGE  # pages in one request (CRIU asks for at most 4 MiB): bounds our buffer
_TASK_PAGEMAP = re.compile(r"pagemap-(\d+)\.img")
INDEX = "k3sys-pagemaps.json"  # in a dump's images: its pagemaps, read at the dump (`write_index`)

# (page image name, offset, length) -> its bytes; raises on failure.
Read = Callable[[str, int, int], bytes | bytearray]
# (page image name, [(offset, length)]): start reading those (a hint; `Read` follows).
Prefetch = Callable[[str, list[tuple[int, int]]], None]


def _varint(data: bytes, at: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[at]
        n |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return n, at


def _fields(msg: bytes) -> dict[int, int]:
    """The varint fields of a protobuf message (all a pagemap has); other wire types are refused.
    One-byte varints (every key, most values) are read inline: a GiB of memory has ~1,000 entries,
    read on the resume's path."""
    out, at, end = {}, 0, len(msg)
    while at < end:
        key = msg[at]
        key, at = (key, at + 1) if key < 0x80 else _varint(msg, at)
        if key & 7:
            raise ValueError(f"field {key >> 3}: wire type {key & 7}, expected a varint")
        if at < end and msg[at] < 0x80:
            out[key >> 3], at = msg[at], at + 1
        else:
            out[key >> 3], at = _varint(msg, at)
    return out


def read_pagemap(path: Path) -> tuple[int, list[tuple[int, int, int]]]:
    """A pagemap image's page image id and its entries (vaddr, pages, flags)."""
    data = path.read_bytes()
    msgs, at = [], 8
    while at < len(data):
        if at + 4 > len(data):
            raise DriverError(f"{path}: truncated image")
        (n,) = struct.unpack_from("<I", data, at)
        msgs.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    try:
        head = _fields(msgs[0])
        entries = [_fields(m) for m in msgs[1:]]
    except (IndexError, ValueError) as e:
        raise DriverError(f"{path}: not a CRIU pagemap ({e})") from e
    # Images without `flags` (older CRIU) keep pages here unless `in_parent`.
    out = [(f.get(1, 0), f.get(2, 0), f.get(4, PE_PARENT if f.get(3) else PE_PRESENT)) for f in entries]
    if any(flags & PE_PARENT for _, _, flags in out):
        raise DriverError(f"{path}: pages in a parent image (never written by k3sys)")
    return head.get(1, 0), out


def write_index(images: Path) -> None:
    """Write `INDEX` into dump `images`: its pagemaps, parsed once (a resume reads them back in well
    under a millisecond instead of parsing ~1,000 entries per GiB on its path)."""
    maps = [[pm.name, *read_pagemap(pm)] for pm in sorted(images.glob("pagemap-*.img"))]
    (images / INDEX).write_text(json.dumps(maps, separators=(",", ":")))


def _pagemaps(images: Path) -> list[tuple[str, int, list[tuple[int, int, int]]]]:
    """(file name, page image id, entries) of every pagemap in `images`: from `INDEX` where the dump
    wrote one, else parsed."""
    try:
        maps = json.loads((images / INDEX).read_bytes())
    except FileNotFoundError:
        return [(pm.name, *read_pagemap(pm)) for pm in sorted(images.glob("pagemap-*.img"))]
    try:
        out = [(str(name), int(pages_id), [(int(v), int(n), int(f)) for v, n, f in entries])
               for name, pages_id, entries in maps]
    except (TypeError, ValueError) as e:
        raise DriverError(f"{images / INDEX}: not an index of pagemaps ({e})") from e
    if any(f & PE_PARENT for _, _, entries in out for _, _, f in entries):
        raise DriverError(f"{images / INDEX}: pages in a parent image (never written by k3sys)")
    return out


class PageServer:
    """The pages of the CRIU images in `images`, whose page images are empty files of their size,
    read with `read` (see the module docstring)."""

    def __init__(self, images: Path, read: Read, prefetch: Prefetch | None = None) -> None:
        self.images, self._read, self._prefetch = images, read, prefetch
        # pid -> sorted (vaddr, end, page image, offset) of its lazy pages
        self._lazy: dict[int, list[tuple[int, int, str, int]]] = {}
        self._present: dict[str, list[tuple[int, int, bool]]] = {}  # page image -> (offset, length, lazy)
        for pagemap, pages_id, entries in _pagemaps(images):
            name = f"pages-{pages_id}.img"
            task = _TASK_PAGEMAP.fullmatch(pagemap)  # shared memory pagemaps are restored eagerly
            off, spans = 0, self._present.setdefault(name, [])
            for vaddr, n, flags in entries:
                if not flags & PE_PRESENT:
                    continue
                lazy = bool(task and flags & PE_LAZY)
                spans.append((off, n * PAGE, lazy))
                if lazy:
                    self._lazy.setdefault(int(task.group(1)), []).append((vaddr, vaddr + n * PAGE, name, off))
                off += n * PAGE
        for runs in self._lazy.values():
            runs.sort()

    def eager(self, lazy: bool) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges (offset, length) per page image that CRIU's restore reads itself (with
        `lazy`, all but the lazy pages), adjacent ones merged."""
        out: dict[str, list[tuple[int, int]]] = {}
        for name, spans in self._present.items():
            runs: list[list[int]] = []
            for off, n, is_lazy in spans:
                if lazy and is_lazy:
                    continue
                if runs and runs[-1][0] + runs[-1][1] == off:
                    runs[-1][1] += n
                else:
                    runs.append([off, n])
            if runs:
                out[name] = [(off, n) for off, n in runs]
        return out

    def fill(self, lazy: bool) -> int:
        """Write the pages CRIU's restore reads into the page images (with `lazy`, all but the lazy
        ones); returns the bytes written."""
        todo = self.eager(lazy)
        if self._prefetch is not None:  # all the reads under way at once
            for name, runs in todo.items():
                self._prefetch(name, runs)
        total = 0
        for name, runs in todo.items():
            fd = os.open(self.images / name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                for off, n in runs:
                    for at in range(off, off + n, _FILL):
                        data = self._read(name, at, min(_FILL, off + n - at))
                        if os.pwrite(fd, data, at) != len(data):
                            raise DriverError(f"{self.images / name}: short write at {at}")
                        total += len(data)
            finally:
                os.close(fd)
        return total

    def serve(self) -> socket.socket:
        """Start serving the lazy pages; returns the daemon's end of the socket pair (to pass with
        `--ps-socket`, then close here)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Ends when the daemon closes its end (it exited) or asks to.
        threading.Thread(target=self._serve, args=(mine,), name="k3sys-pages", daemon=True).start()
        return theirs

    def _serve(self, sock: socket.socket) -> None:
        with sock, contextlib.suppress(OSError):  # the daemon went away: nothing is left to serve
            while (req := _recv(sock, _IOV.size)) is not None:
                cmd, n, vaddr, pid = _IOV.unpack(req)
                if cmd & 0xFFFF in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                    sock.sendall(struct.pack("<i", 0))
                    return
                try:
                    if cmd != PS_IOV_GET or not 0 < n <= _MAX_REQUEST:
                        raise DriverError(f"page server: request {cmd:#x} for {n} pages")
                    data = [self._read(name, off, size) for name, off, size in self._pieces(pid, vaddr, n * PAGE)]
                except Exception:  # noqa: BLE001 - the daemon sees the socket close and fails
                    return
                sock.sendall(_IOV.pack(PE_PRESENT << 16 | PS_IOV_ADD_F, n, vaddr, pid))
                for piece in data:
                    sock.sendall(piece)

    def _pieces(self, pid: int, vaddr: int, size: int) -> list[tuple[str, int, int]]:
        """(page image, offset, length) of `size` bytes of `pid`'s lazy memory from `vaddr`."""
        runs, out, end = self._lazy.get(pid, []), [], vaddr + size
        i = bisect.bisect_right(runs, (vaddr, float("inf"))) - 1
        while vaddr < end:
            if i < 0 or i >= len(runs) or not runs[i][0] <= vaddr < runs[i][1]:
                raise DriverError(f"page server: pid {pid} has no lazy page at {vaddr:#x}")
            start, stop, name, off = runs[i]
            take = min(stop, end) - vaddr
            out.append((name, off + vaddr - start, take))
            vaddr += take
            i += 1
        return out


def _recv(sock: socket.socket, n: int) -> bytes | None:
    """Exactly `n` bytes, or None at the end of the stream."""
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return buf
