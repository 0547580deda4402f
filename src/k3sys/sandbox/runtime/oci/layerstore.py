"""Image layers, each unpacked once, and the templates composed from them by hard links.

    <system dir>/layers/<id>/tree        one layer in overlay's encoding (unpack.py; sealed trees
                                          of build steps are the same): 0/0 character-device
                                          whiteouts, `trusted.overlay.opaque` directories
    <system dir>/layers/<id>/layer.json  {"id", "bytes", "created", "source"}

An id is content-addressed: `sha256-<hex>` of the uncompressed layer tar (the image config's
`diff_id`: the same layer pulled gzipped from a registry and saved plain by docker is one layer), or
`step-<hex>` of a build step's cache key (the hash of everything that made it), or
`rootfs-<hex>` for a built-in template taken as a base.

A template's rootfs is *composed*: its layers applied bottom first into a new tree where every
file is a hard link to its layer's inode (whiteouts delete, an opaque directory drops what is
below), directories made anew with the topmost layer's metadata. Decision (vs. stacking the layers
as overlay lowerdirs): the runtime keeps exactly one template lower, so create, checkpoint, restore
and fork stay as they are (one idmapped mount per template, never one per layer: images have up to
127 layers, and lowerdir strings a page long), and a composed tree costs its directories and names
only (bench/templates.py measures it: ~1% of the data). Layer files are never written in place: a
sandbox writes into its own upper (overlay copies up), and nothing else opens them for writing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from k3sys.sandbox.errors import ImageError
from k3sys.sandbox.runtime.layers import remove_entry, tree_bytes
from k3sys.sandbox.runtime.oci.unpack import IMPLIED, OPAQUE

LAYER_ID = re.compile(r"^(sha256|step|rootfs)-[0-9a-f]{64}$")


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _copy_meta(src: str, dst: str, st: os.stat_result) -> None:
    """A composed directory's owner, mode, xattrs (none of overlay's) and times from its layer's."""
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        if not name.startswith(("trusted.overlay.", "trusted.k3sys.")):
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _apply(src: str, dst: str) -> None:
    """Layer directory `src` applied onto composed directory `dst` (both exist)."""
    with os.scandir(src) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        st = e.stat(follow_symlinks=False)
        out = os.path.join(dst, e.name)
        if _is_whiteout(st):
            remove_entry(out)
        elif stat.S_ISDIR(st.st_mode):
            xattrs = os.listxattr(e.path, follow_symlinks=False)
            try:
                keep = stat.S_ISDIR(os.lstat(out).st_mode) and OPAQUE not in xattrs
            except FileNotFoundError:
                keep = False
            if not keep:
                remove_entry(out)  # a lower's link or file at a directory's place goes, never followed
                os.mkdir(out, 0o700)
            _apply(e.path, out)
            if not (keep and IMPLIED in xattrs):  # an implied directory keeps the lower one's metadata
                _copy_meta(e.path, out, st)
        else:
            remove_entry(out)
            os.link(e.path, out, follow_symlinks=False)


class LayerStore:
    """The layers under `root` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def tree(self, lid: str) -> Path:
        """The unpacked tree of layer `lid` (ImageError for an id of the wrong shape)."""
        if not LAYER_ID.match(lid):
            raise ImageError(f"layer id: expected sha256-/step-/rootfs-<64 hex>, got {lid!r}")
        return self.root / lid / "tree"

    def has(self, lid: str) -> bool:
        return (self.tree(lid).parent / "layer.json").is_file()

    def info(self, lid: str) -> dict:
        """The layer's layer.json: id, bytes (its tree's, each inode once), created, source."""
        return json.loads((self.root / lid / "layer.json").read_text())

    def add(self, lid: str, fill: Callable[[Path], None], source: str) -> bool:
        """Make layer `lid` by `fill(tree)` into a new empty directory, unless it exists; True if made.
        Filled aside and renamed into place, so a failed or concurrent fill never leaves half a layer."""
        final = self.tree(lid).parent
        if self.has(lid):
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{lid}.{os.getpid()}.{time.monotonic_ns()}"
        (tmp / "tree").mkdir(parents=True)
        try:
            fill(tmp / "tree")
            meta = {"id": lid, "bytes": tree_bytes(tmp / "tree"), "created": time.time(), "source": source}
            (tmp / "layer.json").write_text(json.dumps(meta))
            try:
                os.rename(tmp, final)
            except OSError:  # another process made it meanwhile (a non-empty directory is not replaced)
                if not self.has(lid):
                    raise
                return False
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def compose(self, lids: list[str], dest: Path) -> None:
        """Apply layers `lids` (bottom first) into the new directory `dest` (see the module docstring)."""
        os.mkdir(dest, 0o755)
        for lid in lids:
            tree = self.tree(lid)
            if not tree.is_dir():
                raise ImageError(f"layer {lid} is not in the layer store {self.root}")
            _apply(str(tree), str(dest))
        if lids:
            _copy_meta(str(self.tree(lids[-1])), str(dest), os.lstat(self.tree(lids[-1])))

    def lookup(self, lids: list[str], rel: str) -> os.stat_result | None:
        """What path `rel` (relative, `/`-separated, no `..`) is in the composition of `lids`, read
        from the topmost layer that has it (None: absent or whited out); links are not followed."""
        parts = [p for p in rel.split("/") if p]
        if not parts:
            return os.lstat(self.tree(lids[-1])) if lids else None
        for lid in reversed(lids):
            path = self.tree(lid)
            for i, p in enumerate(parts):
                try:
                    st = os.lstat(path / p)
                except (FileNotFoundError, NotADirectoryError):
                    if i > 0 and OPAQUE in os.listxattr(path, follow_symlinks=False):
                        return None  # an opaque directory of this layer hides the layers below
                    break
                if _is_whiteout(st) or (i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode)):
                    return None  # whited out, or a file where a parent directory would be
                path = path / p
            else:
                return st
        return None

    def ids(self) -> list[str]:
        """Every layer held."""
        return sorted(p.name for p in self.root.iterdir() if LAYER_ID.match(p.name)) if self.root.is_dir() else []

    def collect(self, keep: set[str]) -> list[str]:
        """Delete every layer not in `keep` (renamed out of the way first, so a concurrent reader
        never sees half of one); returns their ids. The caller holds the templates' lock."""
        gone = []
        for lid in self.ids():
            if lid in keep:
                continue
            aside = self.root / f".gone-{lid}-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.root / lid, aside)
                shutil.rmtree(aside)
                gone.append(lid)
        return gone
