"""FileReader (ranges of a checkpoint's files straight from the packs) and checkouts that leave page
images as holes, against the committed bytes."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from k3sys.sandbox.runtime.store import Store, StoreInputError
from k3sys.sandbox.runtime.store.reader import FileReader

PAGE = 4096


def _images(root: Path, pages: bytes, other: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pages-1.img").write_bytes(pages)
    (root / "core-1.img").write_bytes(other)
    return root


@pytest.fixture
def two_commits(tmp_path: Path) -> tuple[Store, str, bytes, bytes]:
    """A checkpoint whose page image lies in two packs (every third page changed since its parent),
    with runs of zero pages, and a file of 64 KiB chunks with a short last chunk."""
    rng = random.Random(1)
    store = Store(tmp_path / "store")
    pages = bytearray(rng.randbytes(600 * PAGE))
    pages[100 * PAGE : 140 * PAGE] = bytes(40 * PAGE)
    first = store.commit({"images": _images(tmp_path / "a", bytes(pages), b"x" * 1000)})
    for i in range(0, 600, 3):
        if not 100 <= i < 140:
            pages[i * PAGE : (i + 1) * PAGE] = rng.randbytes(PAGE)
    other = rng.randbytes(200_000)
    m = store.commit({"images": _images(tmp_path / "b", bytes(pages), other)}, parent=first.id)
    assert len(list((tmp_path / "store" / "packs").iterdir())) == 2
    return store, m.id, bytes(pages), other


def test_any_range_reads_as_committed(two_commits):
    store, ck, pages, other = two_commits
    reader = FileReader(store, ck, "images")
    try:
        assert sorted(reader.sizes()) == [("core-1.img", len(other)), ("pages-1.img", len(pages))]
        rng = random.Random(2)
        for name, data in (("pages-1.img", pages), ("core-1.img", other)):
            ranges = [(0, len(data)), (len(data) - 1, 1), (len(data) // 6 - 5, len(data) // 12)]
            ranges += [(o, rng.randrange(0, len(data) - o + 1)) for o in rng.sample(range(len(data)), 60)]
            for off, n in ranges:
                assert reader.read(name, off, n) == data[off : off + n], (name, off, n)
    finally:
        reader.close()


def test_prefetched_ranges_read_as_committed(two_commits):
    """`prefetch` (the kernel starts reading, the reader keeps where the bytes lie) then `read` of
    the same ranges, across both packs and the zero runs; a closed reader reads nothing it planned."""
    store, ck, pages, other = two_commits
    ranges = [(0, 150 * PAGE), (99 * PAGE + 7, 45 * PAGE), (len(pages) - PAGE, PAGE)]
    reader = FileReader(store, ck, "images")
    try:
        reader.prefetch("pages-1.img", ranges)
        reader.prefetch("core-1.img", [(1, len(other) - 1)])
        for off, n in ranges:
            assert reader.read("pages-1.img", off, n) == pages[off : off + n]
        assert reader.read("core-1.img", 1, len(other) - 1) == other[1:]
        with pytest.raises(StoreInputError, match="outside"):
            reader.prefetch("pages-1.img", [(len(pages), 1)])
        reader.prefetch("pages-1.img", ranges[:1])
    finally:
        reader.close()
    with pytest.raises(StoreInputError, match="closed"):
        reader.read("pages-1.img", *ranges[0])


def test_ranges_outside_a_file_are_refused_by_name(two_commits):
    store, ck, pages, _ = two_commits
    reader = FileReader(store, ck, "images")
    try:
        with pytest.raises(StoreInputError, match=r"bytes 2457600\.\.2457601 of 'pages-1.img' lie outside"):
            reader.read("pages-1.img", len(pages), 1)
        with pytest.raises(StoreInputError, match=r"'nope.img' lie outside its 0 bytes"):
            reader.read("nope.img", 0, 1)
        with pytest.raises(StoreInputError, match="outside"):
            reader.read("pages-1.img", -1, 2)
    finally:
        reader.close()
    with pytest.raises(StoreInputError, match="closed"):
        reader.read("pages-1.img", 0, 1)
    reader.close()  # idempotent


def test_a_reader_keeps_its_packs_until_closed(two_commits):
    """A delete waits for an open reader (its packs may not go while a sandbox's memory is read
    from them), and goes through once the reader is closed."""
    store, ck, pages, _ = two_commits
    reader = FileReader(store, ck, "images")
    done = threading.Event()
    deleter = threading.Thread(target=lambda: (store.delete(ck), done.set()))
    deleter.start()
    try:
        assert not done.wait(0.5)
        assert reader.read("pages-1.img", 0, len(pages)) == pages
    finally:
        reader.close()
    deleter.join(10)
    assert done.is_set() and store.list()[0].id != ck


def test_checkout_leaves_page_images_as_holes(two_commits, tmp_path: Path):
    store, ck, pages, other = two_commits
    out = Path(tmp_path / "out")
    store.checkout(ck, {"images": out}, holes=lambda path: path.startswith("pages-"))
    st = os.stat(out / "pages-1.img")
    assert st.st_size == len(pages) and st.st_blocks == 0
    assert (out / "core-1.img").read_bytes() == other
