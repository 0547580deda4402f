"""Templates made from layers: sealed (composed and renamed into place), listed, removed, and the
layers nobody needs any more collected. Every change holds the templates' lock (templates.py).

A sealed template is `<system dir>/templates/<name>/` with `rootfs/` (composed from its layers by
hard links: layerstore.py) and `template.json`:

    {"name", "built", "layers": [ids, bottom first], "source": what it came from,
     "bytes": its layers' bytes, "env", "cwd", "user", "entrypoint", "cmd"}

Names starting with `_` are the builder's own (a RUN step's stage: builder.py), never listed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3sys.sandbox.errors import ImageError, InvalidArgumentError, InvalidStateError, UnknownTemplateError
from k3sys.sandbox.runtime.oci.image import HashingReader, ImageConfig, decompressed, open_image
from k3sys.sandbox.runtime.oci.layerstore import LayerStore
from k3sys.sandbox.runtime.oci.unpack import unpack_layer
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.templates import BUILDERS, forget_template, templates_lock

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
STAGE_PREFIX = "_"


@dataclass(frozen=True)
class TemplateInfo:
    """A template as listed: `bytes` its layers hold (shared ones counted in full), `layers` how many
    (0: a built-in recipe's plain rootfs)."""

    name: str
    built: float
    bytes: int
    layers: int
    source: str


def check_name(name: str) -> str:
    """`name` if it can name a new template (InvalidArgumentError otherwise)."""
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidArgumentError(f"template name: expected letters, digits, '.', '_' or '-' (not first), "
                                   f"at most 128, got {name!r}")
    if name in BUILDERS:
        raise InvalidArgumentError(f"template name: {name!r} is a built-in template's")
    return name


def layer_store() -> LayerStore:
    """The system directory's layers."""
    return LayerStore(system_paths().layers)


def seal(name: str, layers: list[str], config: ImageConfig, source: str, store: LayerStore,
         meta: dict | None = None) -> Path:
    """Compose `layers` (bottom first) into the new template `name` with `config`'s defaults (and
    `meta`'s fields in its template.json); its
    rootfs. InvalidStateError if the name is taken: a template's sandboxes and checkpoints stand on
    it (a checkpoint's sealed layer is a diff against it), so it is never replaced under them."""
    with templates_lock() as root:
        if (root / name).exists():
            raise InvalidStateError(f"template {name!r} exists: remove it first (k3sys sandbox template rm {name})")
        tmp = root / f".{name}.build-{os.getpid()}-{time.monotonic_ns()}"
        try:
            tmp.mkdir()
            store.compose(layers, tmp / "rootfs")
            doc = {"name": name, "built": time.time(), "layers": layers, "source": source,
                   "bytes": sum(store.info(lid)["bytes"] for lid in layers), **config.fields(), **(meta or {})}
            (tmp / "template.json").write_text(json.dumps(doc))
            os.rename(tmp, root / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        forget_template(name)
        return root / name / "rootfs"


def _meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "template.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def list_templates() -> list[TemplateInfo]:
    """Every built template, by name (build stages left out)."""
    root = system_paths().templates
    out = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if p.name.startswith((".", STAGE_PREFIX)) or not (p / "rootfs").is_dir():
            continue
        m = _meta(p)
        layers = m.get("layers") if isinstance(m.get("layers"), list) else []
        out.append(TemplateInfo(p.name, float(m.get("built") or 0), int(m.get("bytes") or 0), len(layers),
                                str(m.get("source") or "built-in")))
    return out


def template_layers(name: str) -> list[str] | None:
    """Template `name`'s layers, bottom first (None: a built-in recipe's plain rootfs)."""
    path = system_paths().templates / name
    if not (path / "rootfs").is_dir():
        raise UnknownTemplateError(f"template: unknown template {name!r}")
    layers = _meta(path).get("layers")
    return [str(x) for x in layers] if isinstance(layers, list) else None


def template_config(name: str) -> ImageConfig:
    """Template `name`'s defaults as an image config (what a Dockerfile's FROM starts with)."""
    m = _meta(system_paths().templates / name)
    env = m.get("env") if isinstance(m.get("env"), dict) else {}
    return ImageConfig(dict(env), m.get("cwd"), m.get("user"), m.get("entrypoint"), m.get("cmd"))


def sandboxes_on(rootfs: Path) -> int:
    """How many mounts of this host show the directory `rootfs` (a running sandbox's lower is an
    idmapped mount of its template's rootfs: /proc/self/mountinfo names it by device and root)."""
    st = os.stat(rootfs)
    mount = rootfs.resolve()
    while not os.path.ismount(mount):
        mount = mount.parent
    inner = "/" + os.path.relpath(rootfs.resolve(), mount).removeprefix(".")
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[2:4] == [dev, inner.replace(" ", "\\040")])


def remove(name: str, pinned: set[str] = frozenset()) -> list[str]:
    """Remove template `name` (never a built-in one), then every layer no template and no id in
    `pinned` uses; returns the layers removed. InvalidStateError while a running sandbox stands on
    it; a hibernated sandbox or kept checkpoint of it is the caller's to know of (see `seal`)."""
    if name in BUILDERS:
        raise InvalidArgumentError(f"template {name!r} is built in: it is not removed here")
    with templates_lock() as root:
        path = root / name
        if not (path / "rootfs").is_dir() or name.startswith("."):
            raise UnknownTemplateError(f"template: unknown template {name!r}")
        if n := sandboxes_on(path / "rootfs"):
            raise InvalidStateError(f"template {name!r}: {n} running sandbox(es) stand on it: kill them first")
        aside = root / f".{name}.gone-{os.getpid()}"
        os.rename(path, aside)
        shutil.rmtree(aside)
        forget_template(name)
        return collect(pinned)


def collect(pinned: set[str] = frozenset()) -> list[str]:
    """Delete the layers that no template lists and that are not `pinned`; the caller holds the lock."""
    root = system_paths().templates
    used = set(pinned)
    for p in root.iterdir() if root.is_dir() else []:
        layers = _meta(p).get("layers") if (p / "rootfs").is_dir() else None
        used.update(layers if isinstance(layers, list) else [])
    return layer_store().collect(used)


def import_layers(image_source: str, store: LayerStore,
                  log: Callable[[str], None] = print) -> tuple[list[str], ImageConfig]:
    """Unpack the layers of image `image_source` (image.py) the store lacks; (ids, config)."""
    ids = []
    with open_image(image_source) as image:
        for i, blob in enumerate(image.layers):
            lid = blob.diff_id.replace(":", "-")

            def fill(tree: Path, blob=blob) -> None:
                with blob.open() as raw, decompressed(raw) as tar:
                    r = HashingReader(tar, blob.diff_id, f"layer {blob.diff_id}")
                    unpack_layer(r, tree, blob.diff_id)  # type: ignore[arg-type]
                    r.check()

            made = store.add(lid, fill, image_source)
            log(f"layer {i + 1}/{len(image.layers)} {blob.diff_id[:19]}: {'unpacked' if made else 'already held'}")
            ids.append(lid)
        return ids, image.config


def import_image(image_source: str, name: str, log: Callable[[str], None] = print) -> Path:
    """Template `name` from image `image_source`: its layers unpacked once into the layer store, its
    config as the template's defaults; the new template's rootfs. A failed import leaves no template
    (layers it unpacked stay, for the next try, until `collect`)."""
    check_name(name)
    if (system_paths().templates / name).exists():
        raise InvalidStateError(f"template {name!r} exists: remove it first (k3sys sandbox template rm {name})")
    store = layer_store()
    try:
        ids, config = import_layers(image_source, store, log)
    except OSError as e:
        raise ImageError(f"image {image_source!r}: {e}") from None
    return seal(name, ids, config, image_source, store)
