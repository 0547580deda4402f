"""Moving checkpoints between two stores: only missing chunks travel, every byte is checked on
arrival, and a cut or forged transfer leaves the target as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3sys.sandbox.runtime.store import CheckpointNotFoundError, CorruptStoreError, Store, StoreInputError
from k3sys.sandbox.runtime.store.transfer import Importer, batches, chunk_lengths, export_manifest, read_chunks


def tree(root: Path, seed: int, pages: int = 256, extra: bytes = b"") -> Path:
    """A directory with a CRIU-like page image (`pages` random 4 KiB pages of `seed`) and a small file."""
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(_pages(seed, pages))
    (root / "images" / "note.txt").write_bytes(b"hello" + extra)
    return root / "images"


def _pages(seed: int, n: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n * 4096)


def move(src: Store, dst: Store, ck: str, limit: int = 1 << 20) -> int:
    """Transfer `ck` from `src` to `dst` the way fleet nodes do; returns the chunk bytes moved."""
    imp = Importer(dst, export_manifest(src, ck))
    try:
        for batch in batches(imp.needed, imp.lengths, limit):
            imp.add(batch, read_chunks(src, ck, batch))
        imp.finish()
    finally:
        imp.abort()
    return imp.received


def read_back(store: Store, ck: str, dest: Path) -> bytes:
    store.checkout(ck, {"t": dest})
    return (dest / "pages-1.img").read_bytes() + (dest / "note.txt").read_bytes()


def test_second_checkpoint_of_a_family_moves_only_what_changed(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    first = a.commit({"t": tree(tmp_path / "1", seed=1)}, id="ck1")
    d2 = tree(tmp_path / "2", seed=1, extra=b" again")
    img = bytearray((d2 / "pages-1.img").read_bytes())
    img[:4096] = b"\x01" * 4096  # one page changed
    (d2 / "pages-1.img").write_bytes(img)
    a.commit({"t": d2}, parent="ck1", id="ck2")

    moved1 = move(a, b, "ck1", limit=64 << 10)  # many batches
    assert moved1 >= 256 * 4096
    assert read_back(b, "ck1", tmp_path / "o1") == read_back(a, "ck1", tmp_path / "p1")
    moved2 = move(a, b, "ck2")
    assert 0 < moved2 < 0.05 * moved1, (moved1, moved2)
    assert read_back(b, "ck2", tmp_path / "o2") == read_back(a, "ck2", tmp_path / "p2")
    assert move(a, b, "ck2") == 0  # already there: nothing moves, same manifest
    assert b.get("ck1").bytes_total == first.bytes_total


def test_forged_chunk_is_refused_and_target_unchanged(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    a.commit({"t": tree(tmp_path / "1", seed=2)}, id="ck1")
    imp = Importer(b, export_manifest(a, "ck1"))
    batch = imp.needed[:4]
    data = bytearray(read_chunks(a, "ck1", batch))
    data[10] ^= 0xFF
    with pytest.raises(CorruptStoreError, match="other bytes"):
        imp.add(batch, bytes(data))
    with pytest.raises(StoreInputError, match="expected"):
        imp.add(batch, bytes(data[:-1]))
    with pytest.raises(StoreInputError, match="not in checkpoint"):
        imp.add([b"\0" * 32], b"x")
    imp.abort()
    with pytest.raises(CheckpointNotFoundError):
        b.get("ck1")
    assert os.listdir(b.root / "tmp") == [] and os.listdir(b.root / "packs") == []


def test_cut_transfer_publishes_nothing(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    a.commit({"t": tree(tmp_path / "1", seed=3)}, id="ck1")
    imp = Importer(b, export_manifest(a, "ck1"))
    half = imp.needed[: len(imp.needed) // 2]
    imp.add(half, read_chunks(a, "ck1", half))
    with pytest.raises(StoreInputError, match="never arrived"):
        imp.finish()
    with pytest.raises(CheckpointNotFoundError):
        b.get("ck1")
    assert move(a, b, "ck1") > 0  # a later full transfer works
    assert b.verify() == []


def test_bad_manifest_and_unknown_chunk_are_refused(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    a.commit({"t": tree(tmp_path / "1", seed=4)}, id="ck1")
    data = bytearray(export_manifest(a, "ck1"))
    data[20] ^= 1
    with pytest.raises(CorruptStoreError):
        Importer(b, bytes(data))
    with pytest.raises(StoreInputError, match="has no chunk"):
        read_chunks(a, "ck1", [b"\1" * 32])
    lengths = chunk_lengths(a.get("ck1"))
    assert sum(lengths.values()) <= a.get("ck1").bytes_total
    assert [len(x) for x in batches(list(lengths), lengths, 1)] == [1] * len(lengths)
