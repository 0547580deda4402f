"""Checkpoint store: commit and checkout times for a sandbox holding 64 MiB of memory.

Scenario (what a runc sandbox checkpoint hands the store): a CRIU image directory on tmpfs with a
64 MiB `pages-1.img` of random memory plus small images, and a small overlay upper directory. The
store lives on disk. Measured, median over `--runs`:

- first commit into an empty store, beside copying the tree to disk with fsync (no store at all);
- second commit after dirtying 1 MiB (256 random pages: every page hashed, only new digests
  written), beside the copy again;
- a first commit of new data whose images the store followed while they were written, timed from
  the last byte written (how the runtime commits a CRIU dump);
- checkout of each into tmpfs, beside copying the stored tree from disk; also into a tmpfs mounted
  with huge=always where we may mount one (root);
- the two ways to find the changed pages, alone: BLAKE3 per page vs numpy compare with the parent's
  pages (the latter needs them in memory, which O_DIRECT-written packs are not).

Stores stay on disk until the end, as a runtime's store grows (freeing them would hand later runs
recycled page cache). Writes bench/results/store.json.

Writes bench/results/store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from blake3 import blake3
from rich.console import Console
from rich.table import Table

from k3sys.sandbox.runtime.store import Store

PAGE = 4096
MIB = 1 << 20


def make_sandbox(root: Path, mem: np.ndarray) -> dict[str, Path]:
    """A CRIU image dir and an overlay upper dir as a checkpoint would hand them over."""
    criu, upper = root / "criu", root / "upper"
    criu.mkdir(parents=True)
    (criu / "pages-1.img").write_bytes(mem.tobytes())
    for name, size in [("core-1.img", 3000), ("mm-1.img", 1800), ("pagemap-1.img", 900), ("inventory.img", 60),
                       ("fdinfo-2.img", 200), ("files.img", 700)]:
        (criu / name).write_bytes(np.random.default_rng(size).bytes(size))
    (upper / "root").mkdir(parents=True)
    (upper / "root" / ".bash_history").write_bytes(b"ls\n" * 50)
    (upper / "tmp").mkdir()
    (upper / "tmp" / "work.txt").write_bytes(os.urandom(20_000))
    return {"criu": criu, "upper": upper}


def copy_durable(src: Path, dst: Path) -> None:
    """Baseline: copy a tree and fsync every file (storing a checkpoint with no store)."""
    shutil.copytree(src, dst, symlinks=True)
    for dirpath, _, files in os.walk(dst):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def hash_pages(mem: np.ndarray) -> list[bytes]:
    """BLAKE3 of every page, one call each: how the store hashes pages it must hash."""
    view = memoryview(mem)
    return [blake3(view[i : i + PAGE]).digest() for i in range(0, len(view), PAGE)]


def compare_pages(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Which pages are unchanged, by comparing `[pages, PAGE // 8]` uint64 arrays."""
    return (old == new).all(axis=1)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[..., object], *args: object, **kwargs: object) -> tuple[float, float]:
    """Wall time and CPU time (this process, all threads) of `fn(*args, **kwargs)`, in ms.

    On a shared machine the CPU time is the steadier figure: it leaves out waiting for a core.
    """
    t0, c0 = time.perf_counter(), cpu_s()
    fn(*args, **kwargs)
    return (time.perf_counter() - t0) * 1e3, (cpu_s() - c0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--mem-mib", type=int, default=64)
    ap.add_argument("--dirty-pages", type=int, default=256)
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="where the store lives")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "store.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n_pages = args.mem_mib * MIB // PAGE
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="k3sys-bench-"))
    disk = Path(tempfile.mkdtemp(dir=args.disk, prefix="k3sys-bench-"))
    huge = shm / "huge"
    huge.mkdir()
    has_huge = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=1g", "k3sys-bench", str(huge)],
                              capture_output=True).returncode == 0
    t: dict[str, list[tuple[float, float]]] = {}
    ratio = []
    add = lambda key, ms: t.setdefault(key, []).append(ms)
    try:
        for run in range(args.runs):
            mem = rng.integers(0, 256, n_pages * PAGE, dtype=np.uint8)
            v1 = make_sandbox(shm / f"v1-{run}", mem)
            dirty = rng.choice(n_pages, args.dirty_pages, replace=False)
            mem.reshape(n_pages, PAGE)[dirty, :64] ^= 0x5A
            v2 = make_sandbox(shm / f"v2-{run}", mem)
            store = Store(disk / f"store-{run}")
            add("first commit", timed(store.commit, v1, id="first"))
            add("incremental commit", timed(store.commit, v2, parent="first", id="second"))
            ratio.append(store.get("second").bytes_new / store.get("second").bytes_total)
            # As the runtime commits a dump: the store follows the images while they are written (here
            # as fast as tmpfs takes them, about CRIU's pace); timed from the last byte written.
            follower = store.follow(shm / f"v3-{run}" / "criu")
            v3 = make_sandbox(shm / f"v3-{run}", rng.integers(0, 256, n_pages * PAGE, dtype=np.uint8))
            add("first commit, images followed as written", timed(store.commit, v3, id="third", follower=follower))
            add("baseline: copy tree to disk + fsync",
                np.sum([timed(copy_durable, v2[k], disk / f"copy-{run}" / k) for k in v2], axis=0).tolist())
            for name, ck in (("first", "first"), ("incremental", "second")):
                dst = {k: shm / f"out-{ck}-{run}" / k for k in v1}
                add(f"checkout {name} -> tmpfs", timed(store.checkout, ck, dst))
                shutil.rmtree(shm / f"out-{ck}-{run}")
                if has_huge:
                    dst = {k: huge / f"out-{ck}-{run}" / k for k in v1}
                    add(f"checkout {name} -> tmpfs huge=always", timed(store.checkout, ck, dst))
                    shutil.rmtree(huge / f"out-{ck}-{run}")
            add("baseline: copy tree from disk -> tmpfs",
                timed(shutil.copytree, disk / f"copy-{run}", shm / f"cp-{run}", symlinks=True))
            # The two ways of finding changed pages, alone, on the same 64 MiB.
            add("  find changes: BLAKE3 every page", timed(hash_pages, mem))
            old = np.frombuffer((v1["criu"] / "pages-1.img").read_bytes(), np.uint64).reshape(n_pages, PAGE // 8)
            new = mem.view(np.uint64).reshape(n_pages, PAGE // 8)
            add("  find changes: numpy compare, parent in memory", timed(compare_pages, old, new))
            if run == 0:
                assert store.verify() == []
            for p in (shm / f"v1-{run}", shm / f"v2-{run}", shm / f"v3-{run}", shm / f"cp-{run}"):
                shutil.rmtree(p)
    finally:
        if has_huge:
            subprocess.run(["umount", str(huge)], check=False)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)

    med = {k: statistics.median(w for w, _ in v) for k, v in t.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in t.items()}
    targets = {"first commit": 60.0, "incremental commit": 25.0}
    copy_in, copy_out = med["baseline: copy tree to disk + fsync"], med["baseline: copy tree from disk -> tmpfs"]
    table = Table(title=f"the checkpoint store, {args.mem_mib} MiB memory image, {args.dirty_pages} dirty pages, "
                        f"median of {args.runs}")
    for col in ("operation", "wall ms", "cpu ms", "copy ms / ours", "target ms"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for k, ms in med.items():
        base = copy_in if "commit" in k else copy_out if "checkout" in k else None
        table.add_row(k, f"{ms:.1f}", f"{cpu[k]:.1f}", f"{base / ms:.2f}x" if base else "",
                      f"{targets[k]:.0f}" if k in targets else "")
    table.add_row("incremental bytes_new / bytes_total", f"{statistics.median(ratio):.2%}", "", "", "<= 5%")
    Console(width=130).print(table)
    out = {"config": vars(args) | {"huge_tmpfs": has_huge, "loadavg_after": os.getloadavg()},
           "median_wall_ms": med, "median_cpu_ms": cpu, "runs_wall_cpu_ms": t,
           "incremental_bytes_ratio": statistics.median(ratio)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
