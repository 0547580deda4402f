"""Reading OCI images: an image layout directory, an OCI or `docker save` archive, or a registry
reference (pulled into a layout by Debian's `skopeo`, when a registry is reachable).

    oci:DIR[:TAG]        an OCI image layout (a plain DIR too)
    oci-archive:FILE[:TAG]  a tar of one
    docker-archive:FILE  `docker save` output (a plain FILE too: either archive kind is recognised)
    docker://REF         a registry image (skopeo copy, then as a layout)

An image is its config (`ImageConfig`: Env, WorkingDir, User, Entrypoint, Cmd, which become the
template's defaults) and its layers, bottom first, each named by its `diff_id` (the sha256 of the
uncompressed tar) and read as a stream: plain, gzip or zstd, told by their first bytes. Every blob's
sha256 is checked against its name while it is read, every uncompressed layer against its diff_id,
so a tampered layout or archive fails (ImageError) instead of becoming a template. Decision: our own
reader over the stdlib's `tarfile` and `gzip` plus `unpack.py`, not umoci: `umoci unpack` flattens
one image into one bundle (no layer is shared between images, nothing is deduplicated), needs
skopeo to read a `docker save` archive at all, and its safety would be a second tool's to audit;
skopeo is used where only it helps, to talk to registries.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from k3sys.sandbox.errors import ImageError

MAX_JSON = 16 << 20  # bytes: an index, manifest or config larger than this is refused
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


@dataclass(frozen=True)
class ImageConfig:
    """What a template takes from an image config: its sandboxes' defaults."""

    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None

    @classmethod
    def from_oci(cls, doc: dict) -> ImageConfig:
        """From an image config document (its `config` object; absent fields: none)."""
        c = doc.get("config") or {}
        env = dict(e.split("=", 1) for e in c.get("Env") or [] if isinstance(e, str) and "=" in e)
        user = (c.get("User") or "").split(":", 1)[0] or None  # the agent takes a name or uid
        return cls(env, c.get("WorkingDir") or None, user, c.get("Entrypoint") or None, c.get("Cmd") or None)

    def fields(self) -> dict:
        """The template.json fields (templates.TemplateDefaults reads them back)."""
        return {"env": self.env, "cwd": self.cwd, "user": self.user, "entrypoint": self.entrypoint,
                "cmd": self.cmd}


@dataclass
class LayerBlob:
    """One layer: `diff_id` (sha256:<hex> of the uncompressed tar) and `open()`, a context giving the
    blob's bytes as stored (compressed or not), checked against its digest as they are read."""

    diff_id: str
    open: Callable[[], contextlib.AbstractContextManager[BinaryIO]]


@dataclass
class Image:
    source: str
    config: ImageConfig
    layers: list[LayerBlob]


class HashingReader:
    """Reads `raw`, hashing what passes; `check()` reads the rest and compares with `digest`."""

    def __init__(self, raw: BinaryIO, digest: str, what: str) -> None:
        self.raw, self.digest, self.what = raw, digest, what
        self.h = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        b = self.raw.read(n)
        self.h.update(b)
        return b

    def check(self) -> None:
        while self.read(1 << 20):
            pass
        if f"sha256:{self.h.hexdigest()}" != self.digest:
            raise ImageError(f"{self.what}: content does not match its digest {self.digest} "
                             f"(sha256:{self.h.hexdigest()})")


@contextlib.contextmanager
def decompressed(raw: BinaryIO) -> Iterator[BinaryIO]:
    """`raw` uncompressed: gzip and zstd are told by their magic bytes, anything else is a plain tar."""
    head = raw.read(4)
    stream = _Prefixed(head, raw)
    if head[:2] == b"\x1f\x8b":
        with gzip.GzipFile(fileobj=stream) as g:  # type: ignore[arg-type]
            yield g  # type: ignore[misc]
    elif head == b"\x28\xb5\x2f\xfd":
        yield from _zstd(stream)
    else:
        yield stream  # type: ignore[misc]


def _zstd(stream: _Prefixed) -> Iterator[BinaryIO]:
    if shutil.which("zstd") is None:
        raise ImageError("a zstd-compressed layer needs the zstd tool (apt install zstd)")
    proc = subprocess.Popen(["zstd", "-dc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError):
            while b := stream.read(1 << 20):
                proc.stdin.write(b)  # type: ignore[union-attr]
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()  # type: ignore[union-attr]

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        yield proc.stdout  # type: ignore[misc]
    finally:
        proc.stdout.close()  # type: ignore[union-attr]
        proc.kill()
        proc.wait()
        t.join()


class _Prefixed:
    """`head` (bytes already read) followed by the rest of `raw`."""

    def __init__(self, head: bytes, raw: BinaryIO) -> None:
        self.head, self.raw = head, raw

    def read(self, n: int = -1) -> bytes:
        if self.head:
            b, self.head = (self.head, b"") if n < 0 or n >= len(self.head) else (self.head[:n], self.head[n:])
            return b if n < 0 or len(b) == n else b + self.raw.read(n - len(b))
        return self.raw.read(n)


class _Files:
    """The files of an image: under a directory, or members of an uncompressed tar archive."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.tar = None if where.is_dir() else tarfile.open(where, "r:")  # noqa: SIM115 (closed by open_image)
        self.members = {} if self.tar is None else {
            m.name.removeprefix("./"): m for m in self.tar.getmembers() if m.isfile()}

    def exists(self, name: str) -> bool:
        return (self.where / name).is_file() if self.tar is None else name in self.members  # then opened safely

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[BinaryIO]:
        if ".." in name.split("/") or name.startswith("/"):
            raise ImageError(f"{self.where}: blob path {name!r} leaves the image")
        if self.tar is None:
            # Walked without following links: a layout from elsewhere must not make us read the
            # host's files as its blobs.
            fd = os.open(self.where, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for part in name.split("/"):
                    flags = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_RDONLY if part == name.split("/")[-1]
                                                            else os.O_PATH | os.O_DIRECTORY)
                    nxt = os.open(part, flags, dir_fd=fd)
                    os.close(fd)
                    fd = nxt
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(f"{name} is not a regular file")
            except OSError as e:
                os.close(fd)
                raise ImageError(f"{self.where}: {name} is missing, a link or not a plain file ({e})") from None
            with open(fd, "rb") as f:
                yield f
        else:
            if name not in self.members:
                raise ImageError(f"{self.where}: {name} is missing from the archive")
            f = self.tar.extractfile(self.members[name])
            assert f is not None
            yield f

    def json(self, name: str, digest: str | None = None) -> dict:
        with self.open(name) as f:
            raw = f.read(MAX_JSON + 1)
        if len(raw) > MAX_JSON:
            raise ImageError(f"{self.where}: {name} is over {MAX_JSON} bytes")
        if digest is not None and f"sha256:{hashlib.sha256(raw).hexdigest()}" != digest:
            raise ImageError(f"{self.where}: {name} does not match its digest {digest}")
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise ImageError(f"{self.where}: {name} is not JSON: {e}") from None
        if not isinstance(doc, dict | list):
            raise ImageError(f"{self.where}: {name} is not a JSON object")
        return doc  # type: ignore[return-value]

    def blob(self, digest: str) -> str:
        m = _DIGEST.match(digest if isinstance(digest, str) else "")
        if not m:
            raise ImageError(f"{self.where}: expected a sha256:<64 hex> digest, got {digest!r}")
        return f"blobs/sha256/{m.group(1)}"


def _pick(manifests: list[dict], tag: str | None, where: Path) -> dict:
    """The manifest descriptor for `tag` (its ref.name annotation), else the host's platform, else the only one."""
    if tag is not None:
        named = [m for m in manifests if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag]
        if not named:
            raise ImageError(f"{where}: no image tagged {tag!r}")
        return named[0]
    mine = [m for m in manifests if (m.get("platform") or {}).get("architecture") in (None, _ARCH)]
    if len(mine) == 1 or (mine and all("platform" in m for m in mine)):
        return mine[0]
    if len(manifests) == 1:
        return manifests[0]
    raise ImageError(f"{where}: {len(manifests)} images and no tag to choose one (oci:DIR:TAG)")


def _from_layout(files: _Files, tag: str | None, source: str) -> Image:
    desc = _pick(files.json("index.json").get("manifests") or [], tag, files.where)
    for _ in range(4):  # an index may point at an index (multi-platform)
        doc = files.json(files.blob(desc.get("digest")), desc.get("digest"))
        if desc.get("mediaType") not in _INDEX_TYPES and doc.get("mediaType") not in _INDEX_TYPES:
            break
        desc = _pick(doc.get("manifests") or [], None, files.where)
    else:
        raise ImageError(f"{files.where}: indexes nested too deep")
    cdesc = doc.get("config") or {}
    config = files.json(files.blob(cdesc.get("digest")), cdesc.get("digest"))
    blobs = [d.get("digest") for d in doc.get("layers") or []]
    return _image(files, source, config, [files.blob(d) for d in blobs], blobs)


def _from_docker_archive(files: _Files, source: str) -> Image:
    entries = files.json("manifest.json")
    if not isinstance(entries, list) or len(entries) != 1:
        raise ImageError(f"{files.where}: expected one image in manifest.json, got {len(entries)}")
    e = entries[0]
    config = files.json(e.get("Config", ""))
    return _image(files, source, config, list(e.get("Layers") or []), [None] * len(e.get("Layers") or []))


def _image(files: _Files, source: str, config: dict, names: list[str], digests: list[str | None]) -> Image:
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) != len(names):
        raise ImageError(f"{files.where}: {len(names)} layers but {len(diff_ids)} diff_ids in the config")
    layers = []
    for name, digest, diff_id in zip(names, digests, diff_ids, strict=True):
        if not isinstance(diff_id, str) or not _DIGEST.match(diff_id):
            raise ImageError(f"{files.where}: bad diff_id {diff_id!r}")

        @contextlib.contextmanager
        def opened(name: str = name, digest: str | None = digest) -> Iterator[BinaryIO]:
            with files.open(name) as raw:
                if digest is None:
                    yield raw
                    return
                r = HashingReader(raw, digest, f"{files.where}: blob {digest}")
                yield r  # type: ignore[misc]
                r.check()

        layers.append(LayerBlob(diff_id, opened))
    return Image(source, ImageConfig.from_oci(config), layers)


@contextlib.contextmanager
def open_image(source: str) -> Iterator[Image]:
    """The image `source` names (see the module docstring); ImageError if it cannot be read."""
    kind, _, rest = source.partition(":") if re.match(r"^(oci|oci-archive|docker-archive|docker):", source) \
        else ("", "", source)
    if kind == "docker":
        with _pulled(rest.removeprefix("//"), source) as image:
            yield image
        return
    path, tag = (rest.rsplit(":", 1) if kind in ("oci", "oci-archive") and ":" in rest
                 and not Path(rest).exists() else (rest, None))
    where = Path(path)
    if not where.exists():
        raise ImageError(f"image {source!r}: {where} does not exist")
    try:
        files = _Files(where)
    except (tarfile.TarError, OSError) as e:
        raise ImageError(f"image {source!r}: {where} is neither a directory nor a plain tar archive: {e}") from None
    try:
        if kind != "oci" and files.exists("manifest.json") and tag is None:
            yield _from_docker_archive(files, source)
        elif files.exists("index.json"):
            yield _from_layout(files, tag, source)
        else:
            raise ImageError(f"image {source!r}: neither an OCI layout (index.json) nor a docker archive "
                             "(manifest.json)")
    finally:
        if files.tar is not None:
            files.tar.close()


@contextlib.contextmanager
def _pulled(ref: str, source: str) -> Iterator[Image]:
    """Registry image `ref`, copied by skopeo into a temporary OCI layout."""
    if shutil.which("skopeo") is None:
        raise ImageError(f"image {source!r}: pulling from a registry needs skopeo (scripts/install-sandbox.sh)")
    with tempfile.TemporaryDirectory(prefix="k3sys-pull-") as tmp:
        # --insecure-policy: no signature policy is configured here; the digests are checked on read.
        cmd = ["skopeo", "--insecure-policy", "copy", "--quiet", f"docker://{ref}", f"oci:{tmp}/image:pulled"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise ImageError(f"image {source!r}: skopeo copy failed ({p.returncode}): {p.stderr.strip()[-1500:]}")
        with open_image(f"oci:{tmp}/image:pulled") as image:
            image.source = source
            yield image
