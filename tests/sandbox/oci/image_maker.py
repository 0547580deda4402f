"""Small OCI images made by the tests (no registry, no docker): layers as lists of tar entries,
written as an OCI image layout or a `docker save` archive."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Entry:
    """One tar entry: `kind` is file, dir, symlink, hardlink, chr, fifo."""

    name: str
    kind: str = "file"
    data: bytes = b""
    link: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    pax: dict[str, str] = field(default_factory=dict)


_TYPES = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
          "hardlink": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE, "fifo": tarfile.FIFOTYPE}


def layer_tar(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            ti = tarfile.TarInfo(e.name)
            ti.type = _TYPES[e.kind]
            ti.mode, ti.uid, ti.gid, ti.mtime = e.mode, e.uid, e.gid, 1_700_000_000
            ti.linkname = e.link
            ti.pax_headers = dict(e.pax)
            if e.kind == "chr":
                ti.devmajor, ti.devminor = 1, 3
            ti.size = len(e.data) if e.kind == "file" else 0
            tf.addfile(ti, io.BytesIO(e.data) if e.kind == "file" else None)
    return buf.getvalue()


def tree_entries(root: Path, prefix: str = "") -> list[Entry]:
    """Entries for every file of the directory `root` (links kept as links)."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = prefix + str(p.relative_to(root))
        st = p.lstat()
        if p.is_symlink():
            out.append(Entry(rel, "symlink", link=str(p.readlink()), mode=0o777))
        elif p.is_dir():
            out.append(Entry(rel, "dir", mode=st.st_mode & 0o7777))
        else:
            out.append(Entry(rel, "file", p.read_bytes(), mode=st.st_mode & 0o7777))
    return out


def _digest(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def config_doc(diff_ids: list[str], config: dict | None) -> bytes:
    return json.dumps({"architecture": "amd64", "os": "linux", "config": config or {},
                       "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()


def oci_layout(dest: Path, layers: list[list[Entry]], config: dict | None = None, gzipped: bool = True,
               tag: str = "latest") -> Path:
    """An OCI image layout at `dest` holding one image of `layers` (bottom first)."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(b: bytes) -> str:
        d = _digest(b)
        (blobs / d[7:]).write_bytes(b)
        return d

    tars = [layer_tar(entries) for entries in layers]
    descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gzipped else ""),
              "digest": put(gzip.compress(t, mtime=0) if gzipped else t), "size": 0} for t in tars]
    cfg = config_doc([_digest(t) for t in tars], config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": put(cfg), "size": len(cfg)}, "layers": descs}).encode()
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(manifest),
         "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return dest


def docker_archive(dest: Path, layers: list[list[Entry]], config: dict | None = None) -> Path:
    """A `docker save` archive (the classic layout: <id>/layer.tar) of one image."""
    tars = [layer_tar(entries) for entries in layers]
    cfg = config_doc([_digest(t) for t in tars], config)
    members = {f"{_digest(cfg)[7:]}.json": cfg}
    names = []
    for t in tars:
        names.append(f"{_digest(t)[7:]}/layer.tar")
        members[names[-1]] = t
    members["manifest.json"] = json.dumps([{"Config": f"{_digest(cfg)[7:]}.json", "RepoTags": ["test:latest"],
                                            "Layers": names}]).encode()
    with tarfile.open(dest, "w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return dest
