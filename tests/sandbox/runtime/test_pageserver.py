"""drivers/pageserver.py against images written here in CRIU's format: what `fill` writes before a
restore, what `serve` answers in CRIU's page-server protocol, and what it refuses."""

from __future__ import annotations

import random
import socket
import struct
from pathlib import Path

import pytest

from k3sys.sandbox import DriverError
from k3sys.sandbox.runtime.drivers.pageserver import (
    INDEX,
    PAGE,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    PS_IOV_CLOSE,
    PS_IOV_GET,
    PageServer,
    read_pagemap,
    write_index,
)

IOV = struct.Struct("<IIQQ")


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def message(**fields: int) -> bytes:
    """A protobuf message of varint fields given as f<number>=value."""
    return b"".join(varint(int(k[1:]) << 3) + varint(v) for k, v in fields.items())


def image(*msgs: bytes) -> bytes:
    """A CRIU image: magics, then length-prefixed messages."""
    return struct.pack("<II", 0x54564319, 0x56084025) + b"".join(struct.pack("<I", len(m)) + m for m in msgs)


def pagemap(pages_id: int, *entries: tuple[int, int, int]) -> bytes:
    return image(message(f1=pages_id), *(message(f1=v, f2=n, f4=flags) for v, n, flags in entries))


LAZY = PE_LAZY | PE_PRESENT
# pid 7: 3 lazy pages at 0x10000, 2 eager ones at 0x40000, 1 lazy one right after the first three
# (a request may span both lazy entries), 4 pages absent (no data in the page image).
TASK = [(0x10000, 3, LAZY), (0x40000, 2, PE_PRESENT), (0x13000, 1, LAZY), (0x80000, 4, 0)]
SHMEM = [(0x0, 2, LAZY)]  # shared memory: restored eagerly whatever its flags


@pytest.fixture
def images(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """An image directory whose page images are holes, and the bytes they stand for."""
    rng = random.Random(3)
    data = {"pages-1.img": rng.randbytes(6 * PAGE), "pages-2.img": rng.randbytes(2 * PAGE)}
    (tmp_path / "pagemap-7.img").write_bytes(pagemap(1, *TASK))
    (tmp_path / "pagemap-shmem-9.img").write_bytes(pagemap(2, *SHMEM))
    for name, b in data.items():
        with open(tmp_path / name, "wb") as f:
            f.truncate(len(b))
    return tmp_path, data


def reader(data: dict[str, bytes], calls: list | None = None):
    def read(name: str, off: int, n: int) -> bytes:
        if calls is not None:
            calls.append((name, off, n))
        return data[name][off : off + n]
    return read


def test_pagemap_round_trip(images):
    path, _ = images
    assert read_pagemap(path / "pagemap-7.img") == (1, TASK)


def test_the_dumps_index_stands_for_the_pagemaps(images):
    """`write_index` (at the dump) gives a resume the pagemaps without parsing them: the same pages
    written and served; an index that is not one is refused."""
    path, data = images
    parsed = PageServer(path, reader(data))
    write_index(path)
    indexed = PageServer(path, reader(data))
    assert (indexed._present, indexed._lazy) == (parsed._present, parsed._lazy)
    (path / INDEX).write_text('[["pagemap-7.img", 1, [[4096, "x"]]]]')
    with pytest.raises(DriverError, match="not an index of pagemaps"):
        PageServer(path, reader(data))
    (path / INDEX).write_text(f'[["pagemap-7.img", 1, [[4096, 1, {PE_PARENT | PE_PRESENT}]]]]')
    with pytest.raises(DriverError, match="parent image"):
        PageServer(path, reader(data))


@pytest.mark.parametrize("lazy", [True, False])
def test_fill_writes_what_the_restore_reads(images, lazy: bool):
    path, data = images
    written = PageServer(path, reader(data)).fill(lazy)
    task = (path / "pages-1.img").read_bytes()
    # Page image layout: the lazy 3 pages, the 2 eager ones, the lazy 1 (absent entries have none).
    eager = data["pages-1.img"][3 * PAGE : 5 * PAGE]
    if lazy:
        assert task == bytes(3 * PAGE) + eager + bytes(PAGE)
        assert written == 2 * PAGE + 2 * PAGE  # the eager task pages and all shared memory
    else:
        assert task == data["pages-1.img"] and written == 8 * PAGE
    assert (path / "pages-2.img").read_bytes() == data["pages-2.img"]


def test_serve_answers_in_criu_protocol(images):
    path, data = images
    calls: list = []
    sock = PageServer(path, reader(data, calls)).serve()
    with sock:
        # Spanning both lazy entries: 0x10000..0x14000 = page image bytes 0..3 pages, then page 5.
        sock.sendall(IOV.pack(PS_IOV_GET, 4, 0x10000, 7))
        head = recv(sock, IOV.size)
        cmd, n, vaddr, pid = IOV.unpack(head)
        assert (cmd & 0xFFFF, cmd >> 16, n, vaddr, pid) == (6, PE_PRESENT, 4, 0x10000, 7)
        want = data["pages-1.img"][: 3 * PAGE] + data["pages-1.img"][5 * PAGE : 6 * PAGE]
        assert recv(sock, 4 * PAGE) == want
        sock.sendall(IOV.pack(PS_IOV_GET, 1, 0x12000, 7))  # one page from the middle
        assert recv(sock, IOV.size + PAGE)[IOV.size :] == data["pages-1.img"][2 * PAGE : 3 * PAGE]
        sock.sendall(IOV.pack(PS_IOV_CLOSE, 0, 0, 0))
        assert recv(sock, 4) == struct.pack("<i", 0)
        assert sock.recv(1) == b""  # and it is gone
    assert calls == [("pages-1.img", 0, 3 * PAGE), ("pages-1.img", 5 * PAGE, PAGE), ("pages-1.img", 2 * PAGE, PAGE)]


@pytest.mark.parametrize("request_", [
    IOV.pack(PS_IOV_GET, 1, 0x40000, 7),  # an eager page: the restore wrote it, nobody may ask
    IOV.pack(PS_IOV_GET, 2, 0x13000, 7),  # runs past the lazy memory
    IOV.pack(PS_IOV_GET, 1, 0x10000, 8),  # another pid
    IOV.pack(PS_IOV_GET, 0, 0x10000, 7),  # no pages
    IOV.pack(PS_IOV_GET, 1 << 20, 0x10000, 7),  # more than any request CRIU makes
    IOV.pack(3, 1, 0x10000, 7),  # not a request a lazy-pages daemon sends
], ids=["eager", "past-the-end", "other-pid", "empty", "huge", "open"])
def test_a_bad_request_closes_the_socket(images, request_: bytes):
    """The daemon then fails and its sandbox is killed: never a guess at memory."""
    path, data = images
    sock = PageServer(path, reader(data)).serve()
    with sock:
        sock.sendall(request_)
        sock.settimeout(10)
        assert sock.recv(1) == b""


def test_a_failing_read_closes_the_socket(images):
    path, _ = images

    def broken(name: str, off: int, n: int) -> bytes:
        raise OSError("the disk went away")

    with PageServer(path, broken).serve() as sock:
        sock.sendall(IOV.pack(PS_IOV_GET, 1, 0x10000, 7))
        sock.settimeout(10)
        assert sock.recv(1) == b""


@pytest.mark.parametrize("content, problem", [
    (pagemap(1, (0x1000, 1, PE_PARENT | PE_PRESENT)), "parent image"),
    (image(message(f1=1), b"\x0a\x01x"), "not a CRIU pagemap"),  # a length-delimited field
    (image(message(f1=1), b"\x08\xff"), "not a CRIU pagemap"),  # a varint cut short
    (image(), "not a CRIU pagemap"),  # no head
    (image(message(f1=1))[:-1] + b"", "not a CRIU pagemap"),
], ids=["parent", "wire-type", "varint", "no-head", "truncated"])
def test_bad_pagemaps_are_refused(tmp_path: Path, content: bytes, problem: str):
    (tmp_path / "pagemap-1.img").write_bytes(content)
    with pytest.raises(DriverError, match=problem):
        PageServer(tmp_path, lambda *a: b"")


def recv(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(10)
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        assert got, "the server closed the socket"
        buf += got
    return buf
