"""The checkpoint store against an independent oracle: `os.lstat`/xattr snapshots and per-page BLAKE3."""

from __future__ import annotations

import os
import random
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from blake3 import blake3
from waiting import wait_until

import k3sys.sandbox.runtime.store as store_pkg
from k3sys.sandbox.errors import SandboxError
from k3sys.sandbox.runtime.store import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptStoreError,
    Entry,
    Manifest,
    Store,
    StoreError,
    StoreInputError,
)
from k3sys.sandbox.runtime.store.manifest import decode, encode

PAGE = 4096
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, mknod, trusted.* xattrs)")
SRC = str(Path(__file__).resolve().parents[3] / "src")


# ------------------------------------------------------------------ oracle and fixtures


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything the store promises to keep, read with plain os calls: path -> facts."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            p = os.path.normpath(os.path.join(dirpath, name))
            rel = os.path.relpath(p, root)
            if name == "." and rel != ".":
                continue
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            xattrs = tuple(sorted((n, os.getxattr(p, n, follow_symlinks=False))
                                  for n in os.listxattr(p, follow_symlinks=False)))
            body = (Path(p).read_bytes() if stat.S_ISREG(st.st_mode)
                    else os.readlink(p) if stat.S_ISLNK(st.st_mode) else None)
            mode = None if stat.S_ISLNK(st.st_mode) else stat.S_IMODE(st.st_mode)
            rdev = st.st_rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0
            out[rel] = (kind, mode, st.st_uid, st.st_gid, st.st_mtime_ns, rdev, xattrs, body)
    return out


def page_digests(data: bytes) -> bytes:
    """Reference chunking of a page image: BLAKE3 of each 4 KiB page, concatenated."""
    return b"".join(blake3(data[i : i + PAGE]).digest() for i in range(0, len(data), PAGE))


def write(path: Path, data: bytes, mtime_ns: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def shm(tmp_path_factory: pytest.TempPathFactory):
    """A scratch directory on tmpfs (where the driver puts CRIU images), removed afterwards."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="k3sys-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def make_every_kind(root: Path) -> None:
    """A tree with every file type, odd modes and owners, xattrs, whiteouts and awkward names."""
    root.mkdir(parents=True)
    write(root / "empty", b"")
    write(root / "suid", b"#!/bin/sh\n", 1_600_000_000_123_456_789)
    os.chown(root / "suid", 1234, 5678)
    os.chmod(root / "suid", 0o4755)
    write(root / os.fsdecode(b"bad-\xff\xfe-name.bin"), b"non-utf8 name")
    write(root / "deep/er/still/file.txt", rand(5000, 1))
    os.chmod(root / "deep/er", 0o555)  # read-only directory that has children
    (root / "sticky").mkdir(mode=0o755)
    os.chmod(root / "sticky", 0o1777)
    (root / "opaque").mkdir()
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")
    (root / "moved").mkdir()
    os.setxattr(root / "moved", "trusted.overlay.redirect", b"/old/place")
    os.setxattr(root / "suid", "user.note", b"\x00binary\xff")
    os.mknod(root / "opaque/whiteout", 0o000 | stat.S_IFCHR, os.makedev(0, 0))
    os.mknod(root / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(root / "loop0", 0o660 | stat.S_IFBLK, os.makedev(7, 0))
    os.mkfifo(root / "fifo", 0o640)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.fspath(root / "sock"))
    os.symlink("/etc", root / "abs-link")
    os.symlink("deep/er", root / "rel-link")
    os.symlink("nowhere/at/all", root / "dangling")
    os.setxattr(root / "dangling", "trusted.k3sys", b"on a link", follow_symlinks=False)
    os.chown(root / "dangling", 42, 43, follow_symlinks=False)
    os.utime(root / "dangling", ns=(7, 1_500_000_000_000_000_001), follow_symlinks=False)
    os.utime(root / "opaque", ns=(5, 1_400_000_000_000_000_002))


# ------------------------------------------------------------------ round trips


def test_exports():
    assert set(store_pkg.__all__) == {"CheckpointExistsError", "CheckpointNotFoundError", "CorruptStoreError", "Entry",
                                      "Follower", "Manifest", "Store", "StoreError", "StoreInputError"}
    assert issubclass(StoreError, SandboxError)
    for cls in (CheckpointExistsError, CheckpointNotFoundError, CorruptStoreError, StoreInputError):
        assert issubclass(cls, StoreError)


def test_no_torch_import():
    code = "import sys, k3sys.sandbox.runtime.store; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": SRC})


@root_only
def test_round_trip_every_kind(store: Store, tmp_path: Path, shm: Path):
    make_every_kind(tmp_path / "tree")
    before = snapshot(tmp_path / "tree")
    m = store.commit({"upper": tmp_path / "tree", "criu": tmp_path / "tree/deep"}, meta={"template": "busybox"})
    assert m.meta == {"template": "busybox"} and store.get(m.id) == m
    kinds = {e.path: e.kind for e in m.trees["upper"]}
    assert kinds["sock"] == "sock" and kinds["fifo"] == "fifo" and kinds["loop0"] == "blk"
    assert kinds["opaque/whiteout"] == "chr" and kinds["abs-link"] == "symlink"
    assert "abs-link/passwd" not in kinds and "rel-link/still" not in kinds  # symlinks are not followed
    store.checkout(m.id, {"upper": shm / "upper", "criu": shm / "criu"})
    assert snapshot(shm / "upper") == before
    assert snapshot(shm / "criu") == snapshot(tmp_path / "tree/deep")
    file_bytes = sum(len(v[-1]) for v in before.values() if v[0] == stat.S_IFREG)
    assert m.bytes_total == file_bytes + 5000 and m.bytes_new == file_bytes  # deep/ is in both trees


@pytest.mark.parametrize("name", ["pages-1.img", "data.bin"])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 65535, 65537, 10 << 20], ids=lambda s: f"size{s}")
def test_round_trip_sizes(store: Store, tmp_path: Path, shm: Path, size: int, name: str):
    data = rand(size, size)
    write(tmp_path / "t" / name, data)
    m = store.commit({"t": tmp_path / "t"})
    (entry,) = [e for e in m.trees["t"] if e.kind == "file"]
    assert entry.chunk_size == (PAGE if name.startswith("pages-") else 64 << 10)
    assert entry.chunks == b"".join(blake3(data[i : i + entry.chunk_size]).digest()
                                    for i in range(0, size, entry.chunk_size))
    assert m.bytes_new == size and m.bytes_total == size
    store.checkout(m.id, {"t": shm / "out"})
    assert (shm / "out" / name).read_bytes() == data
    assert store.verify() == []


def test_zero_chunks_come_back_as_holes(store: Store, tmp_path: Path, shm: Path):
    pages = rand(PAGE, 1) + bytes(100 * PAGE) + rand(PAGE, 2) + bytes(50 * PAGE)  # ends in a hole
    blob = bytes(3 << 16) + b"end"
    write(tmp_path / "t/pages-1.img", pages)
    write(tmp_path / "t/blob.bin", blob)
    m = store.commit({"t": tmp_path / "t"})
    assert m.bytes_new == 3 * PAGE + (1 << 16) + 3  # one zero page, one zero block, the rest
    store.checkout(m.id, {"t": shm / "out"})
    assert (shm / "out/pages-1.img").read_bytes() == pages and (shm / "out/blob.bin").read_bytes() == blob
    assert os.stat(shm / "out/pages-1.img").st_blocks * 512 <= 2 * PAGE  # only the two data pages
    assert os.stat(shm / "out/blob.bin").st_blocks * 512 <= PAGE


# ------------------------------------------------------------------ following images as CRIU writes them


def test_follower_packs_page_images_while_they_grow(store: Store, shm: Path):
    """A writer appends to two page images in uneven pieces (as CRIU does); the follower packs them as
    they grow, and the commit after gives exactly what committing the finished files would."""
    images = shm / "images"
    first = rand(300 * PAGE + 5 * PAGE, 1)  # not a whole window: the tail is read by the last pass
    second = bytes(40 * PAGE) + rand(9 * PAGE, 2) + first[:PAGE]  # zero pages and a repeat within
    follower = store.follow(images)  # the directory does not exist yet
    images.mkdir()
    write(images / "core-1.img", b"core")
    for name, data in (("pages-1.img", first), ("pages-2.img", second)):
        with open(images / name, "wb") as f:
            for at in range(0, len(data), 37 * PAGE):
                f.write(data[at : at + 37 * PAGE])
                f.flush()
                time.sleep(0.002)
    m = store.commit({"images": images}, follower=follower)
    # The follower packed both page images itself (the commit re-chunks only what it did not)...
    done = {os.path.basename(path): n for path, (n, _) in follower._packing.done.items()}
    assert done == {"pages-1.img": len(first), "pages-2.img": len(second)}
    # ... and the result is exactly what committing the finished files gives.
    files = {e.path: e for e in m.trees["images"]}
    assert files["pages-1.img"].chunks == page_digests(first)
    assert files["pages-2.img"].chunks == page_digests(second)
    assert m.bytes_new == len(first) + 10 * PAGE + 4  # one zero page, the repeat stored once, core
    assert store.verify() == [] and os.listdir(store.root / "tmp") == []
    store.checkout(m.id, {"images": shm / "out"})
    assert snapshot(shm / "out") == snapshot(images)


def test_follower_hands_over_its_pack_writer_at_full_priority(store: Store, shm: Path):
    """The follower runs niced during the dump, and so does the pack's writer thread it starts; once
    `take` hands the pack to the commit, that thread writes the rest at the default priority."""
    images = shm / "images"
    images.mkdir()
    follower = store.follow(images)
    with open(images / "pages-1.img", "wb") as f:  # more than ASYNC_BYTES: the writer thread starts
        for i in range(6):
            f.write(rand(256 * PAGE, i))
            f.flush()
            time.sleep(0.01)
    packing = follower.take()
    tid = packing.writer.thread_id
    assert tid is not None, "the follower wrote without a writer thread"
    assert os.getpriority(os.PRIO_PROCESS, tid) == 0
    m = store.commit({"images": images}, follower=follower)
    assert m.bytes_new == 6 * 256 * PAGE


def test_follower_abort_and_changed_files(store: Store, shm: Path):
    images = shm / "images"
    write(images / "pages-1.img", rand(400 * PAGE, 1))
    follower = store.follow(images)
    follower.abort()
    follower.abort()  # idempotent
    assert os.listdir(store.root / "tmp") == [] and store.list() == []
    assert store.gc()["packs"] == 0  # the follower's lock is gone: gc may run
    # A file replaced after the follower read it (another inode) is chunked again by the commit.
    follower = store.follow(images)
    wait_until(lambda: follower._files.get(str(images / "pages-1.img"), [None, 0])[1] >= 400 * PAGE, 10,
               "the follower reading the old pages-1.img")
    changed = rand(400 * PAGE, 2) + rand(PAGE, 3)
    write(shm / "new.img", changed).rename(images / "pages-1.img")
    m = store.commit({"images": images}, follower=follower)
    assert m.trees["images"][1].chunks == page_digests(changed)
    store.checkout(m.id, {"images": shm / "out"})
    assert (shm / "out/pages-1.img").read_bytes() == changed
    # A commit that fails (its id is taken) drops its follower's pack.
    with pytest.raises(CheckpointExistsError):
        store.commit({"images": images}, id=m.id, follower=store.follow(images))
    assert os.listdir(store.root / "tmp") == [] and store.verify() == []


# ------------------------------------------------------------------ dedup and the page diff


def test_incremental_commit_writes_only_changes(store: Store, tmp_path: Path, shm: Path):
    mem = bytearray(rand(8 << 20, 1))
    write(shm / "ck1/pages-1.img", bytes(mem))
    write(shm / "ck1/core-1.img", b"core" * 100)
    write(shm / "up1/log.txt", b"line\n" * 1000)
    a = store.commit({"criu": shm / "ck1", "upper": shm / "up1"})
    assert a.bytes_new == a.bytes_total
    rng = random.Random(2)
    dirty = rng.sample(range(len(mem) // PAGE), 16)
    for p in dirty:
        mem[p * PAGE + 100] ^= 0xFF
    write(shm / "ck2/pages-1.img", bytes(mem))
    write(shm / "ck2/core-1.img", b"core" * 100)
    write(shm / "up2/log.txt", b"line\n" * 1000 + b"one more\n")
    b = store.commit({"criu": shm / "ck2", "upper": shm / "up2"}, parent=a.id)
    # 16 dirty pages plus the log's one (last) 64 KiB block, which grew by a line.
    assert b.bytes_new == 16 * PAGE + 5009
    assert b.bytes_new <= 0.05 * b.bytes_total
    pages = {e.path: e for e in b.trees["criu"]}["pages-1.img"]
    assert pages.chunks == page_digests(bytes(mem))
    # A fork of the same state in another sandbox (no parent given) stores nothing new.
    c = store.commit({"criu": shm / "ck2", "upper": shm / "up2"})
    assert c.bytes_new == 0 and c.trees == b.trees
    store.checkout(b.id, {"criu": shm / "out/criu"})
    assert (shm / "out/criu/pages-1.img").read_bytes() == bytes(mem)


PATTERNS = {
    "same": lambda pages, rng: pages,
    "first-last": lambda pages, rng: [b"\x01" * PAGE, *pages[1:-1], b"\x02" * PAGE],
    "scattered": lambda pages, rng: [rng.randbytes(PAGE) if rng.random() < 0.1 else p for p in pages],
    "grown": lambda pages, rng: pages + [rng.randbytes(PAGE) for _ in range(40)],
    "shrunk": lambda pages, rng: pages[:100],
    "inserted": lambda pages, rng: pages[:50] + [rng.randbytes(PAGE) for _ in range(3)] + pages[50:],
    "swapped": lambda pages, rng: pages[200:] + pages[:200],
    "ragged-tail": lambda pages, rng: pages + [b"tail"],
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_page_diff_matches_full_hashing(store: Store, shm: Path, pattern: str):
    """The parent diff must yield exactly the digests of hashing every page, whatever moved where."""
    rng = random.Random(pattern)
    # A 4 KiB non-page file equal to page 7 of the image: its chunk is stored unaligned, first.
    base = [rng.randbytes(PAGE) for _ in range(300)]
    write(shm / "pre/data.bin", base[7])
    pre = store.commit({"t": shm / "pre"})
    write(shm / "v0/pages-1.img", b"".join(base))
    first = store.commit({"t": shm / "v0"}, parent=pre.id)
    # Spread the parent over several packs: two more generations with some pages rewritten.
    cur, parent = base, first.id
    for gen in (1, 2):
        cur = [rng.randbytes(PAGE) if i % (20 + gen) == 0 else p for i, p in enumerate(cur)]
        write(shm / f"v{gen}/pages-1.img", b"".join(cur))
        parent = store.commit({"t": shm / f"v{gen}"}, parent=parent).id
    new = b"".join(PATTERNS[pattern](cur, rng))
    write(shm / "v3/pages-1.img", new)
    m = store.commit({"t": shm / "v3"}, parent=parent)
    (e,) = [e for e in m.trees["t"] if e.kind == "file"]
    assert e.chunks == page_digests(new)
    store.checkout(m.id, {"t": shm / "out"})
    assert (shm / "out/pages-1.img").read_bytes() == new
    assert store.verify() == []


# ------------------------------------------------------------------ delete, gc, verify


def test_delete_keeps_shared_chunks_and_drops_unreferenced_packs(store: Store, tmp_path: Path, shm: Path):
    shared, only_a, only_b = rand(300_000, 1), rand(200_000, 2), rand(100_000, 3)
    write(tmp_path / "a/shared.bin", shared)
    write(tmp_path / "a/a.bin", only_a)
    write(tmp_path / "b/shared.bin", shared)
    write(tmp_path / "b/b.bin", only_b)
    a = store.commit({"t": tmp_path / "a"})
    b = store.commit({"t": tmp_path / "b"}, parent=a.id)
    c = store.commit({"t": tmp_path / "b"}, parent=b.id)
    assert b.bytes_new == len(only_b) and c.bytes_new == 0
    packs = lambda: sorted(os.listdir(store.root / "packs"))
    assert len(packs()) == 2 and store.stats()["packs"] == 2
    store.delete(b.id)  # c still references everything b did
    assert len(packs()) == 2
    store.delete(a.id)  # the parent goes; its pack stays: c's shared chunks live there
    assert len(packs()) == 2
    store.checkout(c.id, {"t": shm / "c"})
    assert (shm / "c/shared.bin").read_bytes() == shared and (shm / "c/b.bin").read_bytes() == only_b
    st = store.stats()
    assert st["manifests"] == 1 and st["bytes_unique"] == len(shared) + len(only_b)
    assert store.verify() == []
    store.delete(c.id)
    assert packs() == [] and store.stats()["chunks"] == 0
    assert os.listdir(store.root / "manifests") == []
    with pytest.raises(CheckpointNotFoundError, match=c.id):
        store.checkout(c.id, {"t": shm / "gone"})


def test_compact_rewrites_mostly_dead_packs(store: Store, tmp_path: Path, shm: Path):
    keep, drop = rand(40 * PAGE, 1), rand(120 * PAGE, 2)
    write(tmp_path / "a/pages-1.img", drop)
    write(tmp_path / "a/pages-2.img", keep)
    write(tmp_path / "b/pages-2.img", keep)
    write(tmp_path / "b/core.img", b"core")
    a = store.commit({"t": tmp_path / "a"})
    b = store.commit({"t": tmp_path / "b"}, parent=a.id)
    store.delete(a.id)  # a's pack is 25% live: b still needs pages-2.img from it
    before = store.stats()
    assert store.compact(min_live=0.2) == {"packs": 0, "bytes": 0}
    done = store.compact(min_live=0.5)
    after = store.stats()
    assert done["packs"] == 1 and done["bytes"] >= len(drop) - PAGE
    assert after["bytes_on_disk"] == before["bytes_on_disk"] - done["bytes"]
    assert after["bytes_unique"] == before["bytes_unique"] == len(keep) + 4
    assert store.verify() == [] and Store(store.root).verify() == []
    store.checkout(b.id, {"t": shm / "b"})
    assert snapshot(shm / "b") == snapshot(tmp_path / "b")
    # The compacted pages still serve as the parent of a page diff.
    write(tmp_path / "c/pages-2.img", keep[:PAGE] + bytes(PAGE) + keep[2 * PAGE :])
    c = store.commit({"t": tmp_path / "c"}, parent=b.id)
    assert c.bytes_new == PAGE and c.trees["t"][1].chunks == page_digests((tmp_path / "c/pages-2.img").read_bytes())


def test_verify_finds_corruption_and_missing_packs(store: Store, tmp_path: Path, shm: Path):
    write(tmp_path / "a/pages-1.img", rand(64 * PAGE, 1))
    write(tmp_path / "b/other.bin", rand(10_000, 2))
    a = store.commit({"t": tmp_path / "a"})
    b = store.commit({"t": tmp_path / "b"})
    assert store.verify() == []
    pack_a, pack_b = (store.root / "packs" / n for n in sorted(os.listdir(store.root / "packs")))
    if pack_a.stat().st_size < pack_b.stat().st_size:
        pack_a, pack_b = pack_b, pack_a
    with open(pack_a, "r+b") as f:  # flip one byte inside page 5
        f.seek(5 * PAGE + 17)
        byte = f.read(1)
        f.seek(5 * PAGE + 17)
        f.write(bytes([byte[0] ^ 1]))
    problems = store.verify()
    assert len(problems) == 1 and "offset 20480" in problems[0] and "does not match" in problems[0]
    pack_b.unlink()
    problems = store.verify()
    assert any(f"checkpoint {b.id!r}" in p and "missing" in p for p in problems), problems
    with pytest.raises(CorruptStoreError, match="missing"):
        store.checkout(b.id, {"t": shm / "b"})
    assert not (shm / "b").exists()  # a failed checkout leaves nothing behind
    (store.root / "manifests" / f"{a.id}.mf").write_bytes(b"K3SYSMF1 garbage" * 4)
    assert any("checksum mismatch" in p for p in Store(store.root).verify())


# ------------------------------------------------------------------ crash safety

CHILD = textwrap.dedent("""
    import os, random, sys
    from pathlib import Path
    from k3sys.sandbox.runtime.store import Store
    root, work, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    store = Store(root)
    parent = None
    for i in range(n):
        t = work / f"t{i}"
        (t / "up").mkdir(parents=True, exist_ok=True)
        (t / "pages-1.img").write_bytes(random.Random(i).randbytes(256 * 4096))
        (t / "up" / "f.txt").write_bytes(f"version {i}".encode() * 1000)
        if i == n - 1 and os.environ.get("CRASH_LAST"):
            os.environ["K3SYS_STORE_CRASH_AT"] = os.environ["CRASH_LAST"]
        parent = store.commit({"t": t}, parent=parent, meta={"i": i}, id=f"ck{i}").id
        print(parent, flush=True)
""")


def expected_tree(i: int) -> dict[str, bytes]:
    return {"pages-1.img": random.Random(i).randbytes(256 * PAGE), "up/f.txt": f"version {i}".encode() * 1000}


def check_intact(store: Store, dest: Path) -> list[str]:
    ids = [m.id for m in store.list()]
    for m in store.list():
        store.checkout(m.id, {"t": dest / m.id})
        for rel, data in expected_tree(m.meta["i"]).items():
            assert (dest / m.id / rel).read_bytes() == data, (m.id, rel)
    return ids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["after-pack", "before-manifest"])
def test_crash_mid_commit_leaves_earlier_checkpoints(tmp_path: Path, shm: Path, point: str):
    env = {**os.environ, "PYTHONPATH": SRC, "CRASH_LAST": point}
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "s"), str(shm / "w"), "3"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 86, r.stderr
    assert r.stdout.split() == ["ck0", "ck1"]
    store = Store(tmp_path / "s")
    assert check_intact(store, shm / "out") == ["ck0", "ck1"]
    problems = store.verify()
    assert problems and all("gc() removes it" in p for p in problems), problems
    freed = store.gc()
    assert freed["packs"] == 1 and freed["bytes"] > 256 * PAGE // 2
    assert store.verify() == []
    # The store keeps working: the interrupted id can be committed now.
    store.commit({"t": shm / "w/t2"}, parent="ck1", meta={"i": 2}, id="ck2")
    assert check_intact(store, shm / "out2") == ["ck0", "ck1", "ck2"]


@pytest.mark.timeout(60)
def test_sigkill_at_random_times(tmp_path: Path, shm: Path):
    env = {**os.environ, "PYTHONPATH": SRC}
    rng = random.Random(0)
    for attempt in range(3):
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "s"), str(shm / f"w{attempt}"), "40"],
                             env=env, stdout=subprocess.PIPE, text=True)
        first = p.stdout.readline()  # the store is open and committing
        assert first.startswith("ck")
        time.sleep(rng.uniform(0.0, 0.15))
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        store = Store(tmp_path / "s")
        ids = check_intact(store, shm / f"out{attempt}")
        assert "ck0" in ids
        store.gc()
        assert store.verify() == []
        for i in ids:
            store.delete(i)


# ------------------------------------------------------------------ concurrency


@pytest.mark.timeout(60)
def test_threads_commit_checkout_delete_concurrently(store: Store, shm: Path):
    template = rand(64 * PAGE, 99)  # every sandbox is a fork of one template: shared pages
    errors: list[BaseException] = []

    def sandbox(k: int) -> None:
        try:
            parent = None
            for gen in range(4):
                mem = bytearray(template)
                mem[k * PAGE : k * PAGE + 8] = f"{k}:{gen:05}".encode()[:8].ljust(8)
                t = shm / f"s{k}/g{gen}"
                write(t / "pages-1.img", bytes(mem))
                write(t / "up/id", f"{k}-{gen}".encode())
                m = store.commit({"t": t}, parent=parent, id=f"s{k}-g{gen}")
                store.checkout(m.id, {"t": shm / f"s{k}/out{gen}"})
                assert snapshot(shm / f"s{k}/out{gen}") == snapshot(t)
                if parent is not None and gen % 2:
                    store.delete(parent)
                parent = m.id
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=sandbox, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.verify() == []
    left = sorted(m.id for m in store.list())
    assert left == sorted(f"s{k}-g{g}" for k in range(6) for g in (1, 3))
    assert store.stats()["bytes_unique"] < 2 * len(template)  # forks share the template's pages


@pytest.mark.timeout(60)
def test_two_processes_share_a_store(tmp_path: Path, shm: Path):
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        from k3sys.sandbox.runtime.store import Store
        store, name, tree = Store(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
        for i in range(8):
            (tree / f"v{i}").mkdir(parents=True)
            (tree / f"v{i}" / "pages-1.img").write_bytes(bytes([i]) * 4096 * 64 + name.encode() * 4096)
            store.commit({"t": tree / f"v{i}"}, id=f"{name}{i}")
            if i % 2:
                store.delete(f"{name}{i - 1}")
    """)
    env = {**os.environ, "PYTHONPATH": SRC}
    ours = Store(tmp_path / "s")  # open before the others commit: must see their work
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "s"), n, str(shm / n)], env=env)
             for n in ("a", "b")]
    assert [p.wait() for p in procs] == [0, 0]
    assert sorted(m.id for m in ours.list()) == [f"{n}{i}" for n in "ab" for i in (1, 3, 5, 7)]
    assert ours.verify() == []
    ours.checkout("b7", {"t": shm / "out"})
    assert (shm / "out/pages-1.img").read_bytes() == bytes([7]) * 4096 * 64 + b"b" * 4096


@pytest.mark.timeout(60)
def test_same_data_committed_at_once_is_stored_twice_then_reclaimed(store: Store, shm: Path, monkeypatch):
    """Two commits racing with the same new chunks both write them; gc() keeps the older copy only."""
    write(shm / "t/pages-1.img", rand(32 * PAGE, 5))
    barrier = threading.Barrier(2)
    publish = store.catalog.publish_pack

    def held(writer, name: str) -> None:
        barrier.wait(timeout=20)  # both commits have written their packs before either is indexed
        publish(writer, name)

    monkeypatch.setattr(store.catalog, "publish_pack", held)
    threads = [threading.Thread(target=store.commit, args=({"t": shm / "t"},), kwargs={"id": i}) for i in "xy"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    packs = sorted(os.listdir(store.root / "packs"))
    assert len(packs) == 2 and store.get("x").bytes_new == store.get("y").bytes_new == 32 * PAGE
    assert store.verify() == []
    other = Store(store.root)  # another process's view agrees on which copy counts: the older pack
    assert other.gc()["packs"] == 1 and sorted(os.listdir(store.root / "packs")) == packs[:1]
    for i in "xy":
        store.checkout(i, {"t": shm / f"out-{i}"})
        assert snapshot(shm / f"out-{i}") == snapshot(shm / "t")
    store.delete("x")
    store.delete("y")
    assert os.listdir(store.root / "packs") == [] and store.verify() == []


def test_failed_commit_leaves_nothing(store: Store, tmp_path: Path, shm: Path):
    """sysfs files claim 4096 bytes and hold fewer: the commit must fail cleanly and the store go on."""
    sysfs = Path("/sys/kernel/mm/transparent_hugepage")
    if not sysfs.is_dir():
        pytest.skip("no sysfs tree with short files here")
    write(tmp_path / "t/pages-1.img", rand(300 * PAGE, 1))
    with pytest.raises(StoreInputError, match="changed size"):
        store.commit({"big": tmp_path / "t", "sys": sysfs}, id="bad")
    assert os.listdir(store.root / "tmp") == [] and store.list() == []
    for i in range(3):  # the read buffers of the failed commit are not needed again
        m = store.commit({"t": tmp_path / "t"}, id=f"ok{i}")
    assert m.bytes_new == 0 and store.verify() == []


# ------------------------------------------------------------------ bad input


def test_bad_input_is_rejected_by_name(store: Store, tmp_path: Path, shm: Path):
    write(tmp_path / "t/f", b"x")
    m = store.commit({"t": tmp_path / "t"}, id="one")
    with pytest.raises(CheckpointNotFoundError, match="'nope'"):
        store.get("nope")
    with pytest.raises(CheckpointNotFoundError, match="'nope'"):
        store.delete("nope")
    with pytest.raises(CheckpointExistsError, match="'one'"):
        store.commit({"t": tmp_path / "t"}, id="one")
    with pytest.raises(StoreInputError, match=r"checkpoint id '\.\./x'"):
        store.commit({"t": tmp_path / "t"}, id="../x")
    with pytest.raises(StoreInputError, match="tree name 'a/b'"):
        store.commit({"a/b": tmp_path / "t"})
    with pytest.raises(StoreInputError, match="is not a directory"):
        store.commit({"t": tmp_path / "t/f"})
    with pytest.raises(StoreInputError, match="No such file"):
        store.commit({"t": tmp_path / "missing"})
    with pytest.raises(StoreInputError, match="meta is not JSON"):
        store.commit({"t": tmp_path / "t"}, meta={"x": object()})
    write(shm / "full/x", b"")
    with pytest.raises(StoreInputError, match="is not empty"):
        store.checkout(m.id, {"t": shm / "full"})
    with pytest.raises(StoreInputError, match="no tree 'zzz'"):
        store.checkout(m.id, {"zzz": shm / "z"})
    assert [x.id for x in store.list()] == ["one"]


@pytest.mark.parametrize(
    "entries, problem",
    [
        ((Entry("../escape", "file", 0o644, 0, 0, 0),), "'../escape' is not a normalised path"),
        ((Entry("/etc/passwd", "file", 0o644, 0, 0, 0),), "'/etc/passwd' is not a normalised path"),
        ((Entry("a/./b", "dir", 0o755, 0, 0, 0),), "'a/./b' is not a normalised path"),
        ((Entry("ln", "symlink", 0o777, 0, 0, 0, target=".."), Entry("ln/x", "file", 0o644, 0, 0, 0)),
         "'ln/x': parent 'ln' is not a directory"),
        ((Entry("d", "dir", 0o755, 0, 0, 0), Entry("d", "file", 0o644, 0, 0, 0)), "'d' appears twice"),
    ],
    ids=["dotdot", "absolute", "dot", "through-symlink", "duplicate"],
)
def test_hostile_manifest_cannot_escape(store: Store, shm: Path, entries: tuple[Entry, ...], problem: str):
    root = Entry(".", "dir", 0o755, 0, 0, 0)
    m = Manifest("evil", None, 0.0, 0, 0, {}, {"t": (root, *entries)})
    (store.root / "manifests" / "evil.mf").write_bytes(encode(m))
    with pytest.raises(StoreInputError, match=problem):
        store.checkout("evil", {"t": shm / "out"})
    assert not (shm / "out").exists() and not (shm / "x").exists()


def test_manifest_encoding_round_trip():
    e = Entry("a/b", "file", 0o640, 1, 2, 3, size=5, chunk_size=PAGE, chunks=bytes(range(32)),
              xattrs=(("user.x", b"\x00\xff"),))
    m = Manifest("id", "p", 1.5, 5, 5, {"k": [1, "v"]}, {"t": (Entry(".", "dir", 0o755, 0, 0, 0), e)})
    data = encode(m)
    assert decode(data) == m
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 1
    with pytest.raises(CorruptStoreError, match="checksum mismatch"):
        decode(bytes(damaged), "x.mf")
