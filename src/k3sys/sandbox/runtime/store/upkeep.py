"""The store's upkeep: `gc` (crash leftovers), `verify` (every chunk against its digest), `compact`
(rewrite packs mostly dead), `stats` (sizes, read without the lock). The first three take the
store's lock exclusive; see store.py for the rules they keep. Built on a `Catalog`, whose state they
judge and prune."""

from __future__ import annotations

import mmap
import os

from blake3 import blake3

from k3sys.sandbox.runtime.store import chunker
from k3sys.sandbox.runtime.store.catalog import Catalog
from k3sys.sandbox.runtime.store.index import Row
from k3sys.sandbox.runtime.store.pack import PAGE, fsync_dir


class Upkeep:
    """The store's maintenance operations on `catalog` (see the module docstring); no state of their own."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def gc(self) -> dict[str, int]:
        """Remove what interrupted commits and deletes left: temp files and unreferenced packs."""
        cat = self.catalog
        with cat.flock(exclusive=True), cat.mu:
            cat.refresh()
            temps = os.listdir(cat.tdir)
            for name in temps:
                os.unlink(os.path.join(cat.tdir, name))
            cat.settle()
            before = len(cat.index.packs)
            freed = cat.collect(set(cat.index.packs))
            return {"temp_files": len(temps), "packs": before - len(cat.index.packs), "bytes": freed}

    def verify(self) -> list[str]:
        """Re-hash every stored chunk and check every manifest; return the problems ([] if healthy).

        Holds the store's lock exclusively, so commits and checkouts wait until it is done.
        """
        cat = self.catalog
        with cat.flock(exclusive=True):
            with cat.mu:
                cat.refresh()
                cat.settle()
            # From here on the exclusive lock keeps every commit, delete and gc (any process) out.
            index, refs = cat.index, cat.refs
            problems = [f"{name}: {why}" for name, why in sorted(cat.broken.items())]
            problems += [f"leftover temp file tmp/{n} (an interrupted commit; gc() removes it)"
                         for n in sorted(os.listdir(cat.tdir))]
            for m in sorted(cat.manifests.values(), key=lambda m: m.id):
                for name, entries in m.trees.items():
                    for e in entries:
                        missing = [d for d in chunker.split(e.chunks) if d not in index]
                        if missing:
                            problems.append(f"checkpoint {m.id!r} tree {name!r} file {e.path!r}: {len(missing)} "
                                            f"chunk(s) missing, first {missing[0].hex()}")
            # A pack whose chunks all have an older copy elsewhere (two commits wrote them at once) is
            # only wasted space, reclaimed by the next gc(); one that no checkpoint references is debris.
            for p in sorted(index.packs.values(), key=lambda p: p.name):
                label = f"pack {p.name}"
                if not any(d in refs for d, _, _ in p.rows):
                    problems.append(f"{label} holds no chunk any checkpoint references (left by an interrupted "
                                    "commit or delete; gc() removes it)")
                try:
                    with open(p.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                        bad = [(d, off) for d, off, n in p.rows if blake3(memoryview(mm)[off : off + n]).digest() != d]
                except OSError as e:
                    problems.append(f"{label}: cannot read ({e.strerror})")
                    continue
                problems += [f"{label} offset {off}: chunk {d.hex()} does not match its data" for d, off in bad]
            return problems

    def compact(self, min_live: float = 0.5) -> dict[str, int]:
        """Rewrite the still-referenced chunks of packs less than `min_live` full into one new pack.

        Deleting old checkpoints of a long chain leaves packs mostly dead but kept alive by a few
        pages; this bounds that waste. Holds the lock exclusively. Returns counts and bytes freed.
        """
        cat = self.catalog
        with cat.flock(exclusive=True), cat.mu:
            cat.refresh()
            cat.settle()
            victims: dict[int, list[Row]] = {}
            for no, p in cat.index.packs.items():
                live = [r for r in cat.index.indexed_rows(no) if r[0] in cat.refs]
                if live and sum(n for _, _, n in live) < min_live * p.data_end:
                    victims[no] = live
            if not victims:
                return {"packs": 0, "bytes": 0}
            name, writer = cat.new_pack()
            try:
                for no, live in victims.items():
                    with open(cat.index.packs[no].path, "rb") as f, \
                            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                        for d, off, n in live:
                            writer.add([d], mm[off : off + n], PAGE if n == PAGE else n)
                    writer.flush()  # one old pack's worth at a time: memory stays bounded
                writer.finish()
            finally:
                writer.abort()
            cat.index.add(name, writer.rows, writer.offset, os.path.getsize(writer.final_path))
            # The old copies sort first and stay indexed until their packs go; then the new ones take over.
            before = sum(cat.index.packs[no].size for no in victims)
            for no in victims:
                os.unlink(cat.index.remove(no).path)
            fsync_dir(cat.pdir)
            return {"packs": len(victims), "bytes": before - os.path.getsize(writer.final_path)}

    def stats(self) -> dict[str, int]:
        """Sizes in bytes and counts: on disk (packs + manifests), logical, unique chunk data."""
        cat = self.catalog
        with cat.mu:
            cat.refresh()
            cat.settle()
            manifest_bytes = sum(os.path.getsize(os.path.join(cat.mdir, f"{i}.mf")) for i in cat.manifests)
            packs = cat.index.packs
            return {
                "bytes_on_disk": sum(p.size for p in packs.values()) + manifest_bytes,
                "bytes_logical": sum(m.bytes_total for m in cat.manifests.values()),
                "bytes_unique": sum(n for no in packs for d, _, n in cat.index.indexed_rows(no) if d in cat.refs),
                "chunks": len(cat.refs),
                "packs": len(packs),
                "manifests": len(cat.manifests),
            }
