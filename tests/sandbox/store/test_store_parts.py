"""The store's parts alone, each on a real small store in tmp_path: a `Catalog` with only the part
under test built on it (store.py wires all of them; these check that none needs another's state)."""

from __future__ import annotations

import ast
import dataclasses
import os
import random
from pathlib import Path

import pytest

from k3sys.sandbox.errors import CheckpointNotFoundError, CorruptStoreError
from k3sys.sandbox.runtime.store.catalog import Catalog
from k3sys.sandbox.runtime.store.commits import Commits
from k3sys.sandbox.runtime.store.reads import Reads
from k3sys.sandbox.runtime.store.upkeep import Upkeep

PAGE = 4096
SRC = Path(__file__).resolve().parents[3] / "src" / "k3sys"


def tree(root: Path, pages: int, seed: int) -> Path:
    """A small checkpoint-like tree: one page image of random pages (some zero) and a config file."""
    rng = random.Random(seed)
    (root / "sub").mkdir(parents=True)
    data = b"".join(bytes(PAGE) if i % 3 == 0 else rng.randbytes(PAGE) for i in range(pages))
    (root / "pages-1.img").write_bytes(data)
    (root / "sub" / "conf").write_text(f"seed {seed}\n")
    return root


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    return Catalog(tmp_path / "store")


def test_commits_publish_through_the_catalog_and_a_fresh_one_sees_them(catalog: Catalog, tmp_path: Path):
    m = Commits(catalog).commit({"t": tree(tmp_path / "a", 12, 1)}, id="a")
    assert catalog.get("a") == m and [x.id for x in catalog.list()] == ["a"]
    again = Catalog(catalog.root)  # another process: rebuilt from the disk alone
    assert again.get("a") == m and set(again.index.by_name) == set(catalog.index.by_name)
    catalog.delete("a")
    assert again.list() == []  # a listing catches up with another process's delete
    with pytest.raises(CheckpointNotFoundError):
        catalog.get("a")
    assert os.listdir(catalog.pdir) == []  # its only pack went with it


def test_reads_checks_out_and_locates_runs(catalog: Catalog, tmp_path: Path):
    src = tree(tmp_path / "a", 9, 2)
    m = Commits(catalog).commit({"t": src})
    reads = Reads(catalog)
    reads.checkout(m.id, {"t": tmp_path / "out"})
    assert (tmp_path / "out/pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
    assert (tmp_path / "out/sub/conf").read_text() == "seed 2\n"
    e = next(e for e in m.trees["t"] if e.path == "pages-1.img")
    runs = reads.runs(e, f"{m.id}/t")
    with pytest.raises(CorruptStoreError, match="missing"):
        reads.runs(dataclasses.replace(e, chunks=b"\1" * len(e.chunks)), "x/t")
    assert sum(r.size for r in runs) == 9 * PAGE and [r.zero for r in runs][:2] == [True, False]
    fds: dict[int, int] = {}
    try:
        r = runs[1]
        want = (src / "pages-1.img").read_bytes()[PAGE : 2 * PAGE]
        assert os.pread(reads.open_pack(r.pack, fds), PAGE, r.offset) == want
    finally:
        for fd in fds.values():
            os.close(fd)


def test_upkeep_collects_leftovers_and_verify_names_damage(catalog: Catalog, tmp_path: Path):
    upkeep = Upkeep(catalog)
    Commits(catalog).commit({"t": tree(tmp_path / "a", 6, 3)}, id="keep")
    # What a crash leaves: a temp file and a published pack no manifest names.
    (Path(catalog.tdir) / "x.mf").write_bytes(b"half")
    name, writer = catalog.new_pack()
    writer.add([b"\1" * 32], memoryview(bytearray(PAGE)), PAGE)
    catalog.publish_pack(writer, name)
    problems = upkeep.verify()
    assert any("leftover temp file" in p for p in problems) and any(name in p for p in problems)
    debris = os.path.getsize(writer.final_path)
    assert upkeep.gc() == {"temp_files": 1, "packs": 1, "bytes": debris}
    assert upkeep.verify() == [] and upkeep.stats()["manifests"] == 1
    pack = next(iter(catalog.index.packs.values())).path
    with open(pack, "r+b") as f:  # flip a byte of a chunk
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    assert any("does not match its data" in p for p in upkeep.verify())


def test_no_module_imports_another_modules_private_names():
    """The store and the fleet are parts with public interfaces: `from x import _name` is not one."""
    bad = []
    for folder in ("sandbox/runtime/store", "fleet"):
        for path in sorted((SRC / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    bad += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []
