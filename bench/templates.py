"""Templates from images and Dockerfiles (issue 27): what an import costs in time and disk, what a
sibling image adds, what the build cache saves, and what a warm template's create saves over a cold
start of its command (bench/templates_warm.py). One function per section (`--sections`, default all).

The image (no registry is reachable here, so it is built locally; the figures say so): two gzip
layers, ~500 MB uncompressed — the host's `debian` template rootfs (debootstrap minbase + python3,
git; ~280 MB, ~12k files) as the base layer, and an "application" layer of 200 random 1 MiB files
plus 1,000 small text files. Its sibling shares the base layer and has a 20 MiB application layer of
its own. Measured, median over `--runs` (each run on a fresh system directory: cold layers):

- `bench_import`: import of the image (unpack + compose), the bytes stored (layers + the composed
  template, each inode once, directories included), beside the floor: GNU tar unpacking the same
  two gzip layers; then the sibling's import and the bytes it added, beside what a flattened copy
  per template (umoci's way) would have added;
- `bench_build`: a Dockerfile (FROM busybox, COPY of a 10 MB context, two RUNs, WORKDIR) built cold
  (empty layer store), warm (all steps cached, a new name), and with its last step changed (only
  that one runs);
- `api` (bench/templates_api.py): the same Dockerfile's steps built cold through E2B's template API
  (the e2b SDK against a service) and through the CLI.

Writes bench/results/templates.json (merged: sections not run keep their last figures).

    python bench/templates.py [--sections import,build,warm,api] [--runs 3] [--repeats 10]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

MB = 1_000_000
REAL = Path(os.environ.get("K3SYS_SYSTEM_DIR", "/opt/k3sys"))


@contextlib.contextmanager
def system_dir(parent: Path) -> Iterator[Path]:
    """A fresh system directory (templates/ and layers/ its own; bin/, etc/ and the built-in
    templates the real one's), set as K3SYS_SYSTEM_DIR while inside."""
    mine = Path(tempfile.mkdtemp(dir=parent, prefix="sys-"))
    (mine / "templates").mkdir()
    for d in ("bin", "etc", "build", "stamps"):
        if (REAL / d).exists():
            os.symlink(REAL / d, mine / d)
    for t in ("busybox", "debian"):
        if (REAL / "templates" / t / "rootfs").is_dir():
            os.symlink((REAL / "templates" / t).resolve(), mine / "templates" / t)
    before = os.environ.get("K3SYS_SYSTEM_DIR")
    os.environ["K3SYS_SYSTEM_DIR"] = str(mine)
    try:
        yield mine
    finally:
        os.environ["K3SYS_SYSTEM_DIR"] = before or str(REAL)
        shutil.rmtree(mine, ignore_errors=True)


def disk_bytes(*roots: Path) -> int:
    """Bytes allocated under `roots`: every inode once (hard links shared), directories included."""
    seen, total = set(), 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [*dirnames, *filenames, ""]:
                st = os.lstat(os.path.join(dirpath, name)) if name else os.lstat(dirpath)
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def _gz_layer(dest: Path, fill) -> tuple[Path, str]:
    """A gzip layer written by `fill(tarfile)`; its path and diff_id."""
    plain = dest.with_suffix(".tar")
    with tarfile.open(plain, "w", format=tarfile.PAX_FORMAT) as tf:
        fill(tf)
    with open(plain, "rb") as f:
        diff_id = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    subprocess.run(["gzip", "-1", "-f", str(plain)], check=True)
    return plain.with_suffix(".tar.gz"), diff_id


def _random_files(tf: tarfile.TarFile, prefix: str, n: int, size: int, small: int) -> None:
    import io

    for i in range(n):
        ti = tarfile.TarInfo(f"{prefix}/blob-{i:04d}")
        ti.size = size
        tf.addfile(ti, io.BytesIO(os.urandom(size)))
    for i in range(small):
        data = f"# module {i} of {prefix}\n".encode() * 20
        ti = tarfile.TarInfo(f"{prefix}/src/mod_{i:04d}.py")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))


def make_images(work: Path) -> tuple[Path, Path, list[Path]]:
    """The ~500 MB image and its sibling as OCI layouts (see the module docstring); their layers."""
    debian = REAL / "templates" / "debian" / "rootfs"
    base = _gz_layer(work / "base", lambda tf: [tf.add(debian / p, p) for p in sorted(os.listdir(debian))])
    app = _gz_layer(work / "app", lambda tf: _random_files(tf, "opt/app", 200, 1 << 20, 1000))
    sib = _gz_layer(work / "sibling", lambda tf: _random_files(tf, "opt/sibling", 20, 1 << 20, 100))
    return _layout(work / "image", [base, app]), _layout(work / "sibling-image", [base, sib]), [base[0], app[0]]


def _layout(dest: Path, layers: list[tuple[Path, str]]) -> Path:
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes | Path) -> str:
        raw = data.read_bytes() if isinstance(data, Path) else data
        d = hashlib.sha256(raw).hexdigest()
        (blobs / d).write_bytes(raw)
        return f"sha256:{d}"

    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/opt"},
                         "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "config": {"digest": put(config), "size": len(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                       "digest": put(p), "size": p.stat().st_size} for p, _ in layers]}).encode()
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(manifest), "size": len(manifest)}]}))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return dest


def bench_import(work: Path, runs: int) -> dict:
    """Import time and stored bytes of the image, then of its sibling (bytes added); the tar floor."""
    from k3sys.sandbox.runtime.oci import catalog

    image, sibling, layers = make_images(work)
    size = sum(int(subprocess.run(["gzip", "-l", str(p)], capture_output=True, text=True).stdout.split()[5])
               for p in layers)
    rows: dict[str, list[float]] = {k: [] for k in ("import_s", "stored_mb", "sibling_s", "sibling_added_mb",
                                                     "flat_added_mb", "tar_floor_s", "composed_own_mb")}
    for _ in range(runs):
        with system_dir(work) as sysd:
            t0 = time.perf_counter()
            catalog.import_image(str(image), "img", log=lambda _: None)
            rows["import_s"].append(time.perf_counter() - t0)
            stored = disk_bytes(sysd / "layers", sysd / "templates" / "img")
            rows["stored_mb"].append(stored / MB)
            layer_bytes = disk_bytes(sysd / "layers")
            rows["composed_own_mb"].append((stored - layer_bytes) / MB)
            t0 = time.perf_counter()
            catalog.import_image(str(sibling), "sib", log=lambda _: None)
            rows["sibling_s"].append(time.perf_counter() - t0)
            after = disk_bytes(sysd / "layers", sysd / "templates" / "img", sysd / "templates" / "sib")
            rows["sibling_added_mb"].append((after - stored) / MB)
            rows["flat_added_mb"].append(disk_bytes(sysd / "templates" / "sib" / "rootfs") / MB)
        floor = Path(tempfile.mkdtemp(dir=work, prefix="tar-"))
        t0 = time.perf_counter()
        for p in layers:
            subprocess.run(["tar", "-xzf", str(p), "-C", str(floor), "--same-owner", "--numeric-owner"], check=True)
        rows["tar_floor_s"].append(time.perf_counter() - t0)
        shutil.rmtree(floor)
    out = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    out["image_mb"] = round(size / MB, 1)
    out["image"] = ("local OCI layout, 2 gzip layers: the debian template rootfs + 200 random 1 MiB files and "
                    "1,000 small files; sibling: the same base + a 20 MiB layer")
    return out


RUN_DATA = ("mkdir /data && head -c 10000000 /dev/urandom > /data/blob && "
            "for i in $(seq 100); do echo $i > /tmp/f$i; done")
DOCKERFILE = f"FROM busybox\nCOPY ctx /ctx\nRUN {RUN_DATA}\nWORKDIR /app\nRUN echo {{last}} > /app/last\n"


def _context(work: Path) -> Path:
    """The builds' context: ctx/ of 50 random files of 200 kB (10 MB)."""
    ctx = work / "context"
    if not (ctx / "ctx").is_dir():
        (ctx / "ctx").mkdir(parents=True)
        for i in range(50):
            (ctx / "ctx" / f"file-{i}").write_bytes(os.urandom(200_000))
    return ctx


def bench_build(work: Path, runs: int) -> dict:
    """Build seconds: cold (empty layer store), warm (every step cached), last step changed."""
    from k3sys.sandbox.runtime.oci.builder import Builder
    from k3sys.sandbox.runtime.oci.dockerfile import read_dockerfile
    from k3sys.sandbox.runtime.runtime import Runtime

    ctx = _context(work)
    rows: dict[str, list[float]] = {"cold_s": [], "warm_s": [], "last_step_changed_s": []}
    with Runtime(work / "rt") as rt:
        for r in range(runs):
            with system_dir(work):
                b = Builder(rt, log=lambda _: None, memory_mb=512)
                for key, last, name in (("cold_s", "one", "a"), ("warm_s", "one", "b"),
                                        ("last_step_changed_s", f"two-{r}", "c")):
                    res = b.build(read_dockerfile(DOCKERFILE.format(last=last)), name, ctx)
                    rows[key].append(res.seconds)
                    assert res.steps.count("ran") == {"cold_s": 5, "warm_s": 0}.get(key, 1), (key, res.steps)
        rt.kill_all()
    return {k: round(statistics.median(v), 3) for k, v in rows.items()}


def _warm(work: Path, repeats: int) -> dict:
    from k3sys.sandbox import Runtime
    from templates_warm import bench_warm  # bench/ is the script's folder

    with Runtime(work / "rt") as rt:
        try:
            return bench_warm(rt, repeats)
        finally:
            rt.kill_all()


def _api(work: Path, runs: int) -> dict:
    from templates_api import bench_api  # bench/ is the script's folder

    # `runs` kept in the section: the file's top-level `runs` is the last run's, of whichever sections
    return {**bench_api(work, runs, _context(work), DOCKERFILE.format(last="one"), RUN_DATA, system_dir), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="import,build,warm,api")
    ap.add_argument("--runs", type=int, default=3, help="import and build: runs per figure")
    ap.add_argument("--repeats", type=int, default=10, help="warm: creates per figure")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "templates.json")
    args = ap.parse_args()
    sections = {"import": lambda w: bench_import(w, args.runs), "build": lambda w: bench_build(w, args.runs),
                "warm": lambda w: _warm(w, args.repeats), "api": lambda w: _api(w, args.runs)}
    names = [s for s in args.sections.split(",") if s]
    if unknown := [s for s in names if s not in sections]:
        ap.error(f"unknown sections {unknown} (known: {', '.join(sections)})")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    work = Path(tempfile.mkdtemp(prefix="k3sys-bench-templates-", dir="/var/tmp"))
    try:
        for name in names:
            load = os.getloadavg()[0]
            results[name] = {**sections[name](work), "load_1min": [round(load, 1), round(os.getloadavg()[0], 1)]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["runs"], results["repeats"] = args.runs, args.repeats
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    t = Table(title=f"templates ({', '.join(names)}; import/build median of {args.runs}, warm of {args.repeats})")
    for col in ("figure", "value"):
        t.add_column(col)
    for part in names:
        for k, v in results[part].items():
            t.add_row(f"{part}.{k}", str(v))
    Console().print(t)

if __name__ == "__main__":
    main()
