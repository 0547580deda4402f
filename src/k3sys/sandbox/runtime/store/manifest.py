"""Checkpoint manifests: what a checkpoint holds, file by file, and its on-disk encoding.

A manifest lists every chunk of every file it holds (never a delta against its parent), so any
checkpoint can be checked out or deleted on its own. On disk (`manifests/<id>.mf`):

    b"K3SYSMF1" | u32 LE header length | header (JSON, ASCII) | digests | BLAKE3 of all before

The header carries the checkpoint fields and the entries (as lists, for size); `digests` is the
concatenation of every regular file's chunk digests (`DIGEST` bytes each) in entry order. Non-UTF-8
file names survive through `os.fsdecode` (surrogate escapes, which JSON writes as `\\udcXX`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from blake3 import blake3

from k3sys.sandbox.errors import CorruptStoreError

DIGEST = 32  # bytes of a BLAKE3 digest: a chunk's key
MAGIC = b"K3SYSMF1"
KINDS = ("dir", "file", "symlink", "chr", "blk", "fifo", "sock")


@dataclass(frozen=True, slots=True)
class Entry:
    """One file system object of a tree.

    `path` is relative to the tree root (`"."` for the root itself, `/`-separated); `mode` the
    permission bits (`& 0o7777`); `size` and `chunk_size` in bytes (regular files only); `chunks`
    the file's chunk digests concatenated, `ceil(size / chunk_size) * DIGEST` bytes; `target` a
    symlink's target as written; `rdev` a device's (major, minor); `xattrs` sorted (name, value).
    """

    path: str
    kind: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int = 0
    chunk_size: int = 0
    chunks: bytes = b""
    target: str = ""
    rdev: tuple[int, int] = (0, 0)
    xattrs: tuple[tuple[str, bytes], ...] = ()

    @property
    def n_chunks(self) -> int:
        return -(-self.size // self.chunk_size) if self.chunk_size else 0

    def digest(self, i: int) -> bytes:
        """Digest of chunk `i`."""
        return self.chunks[i * DIGEST : (i + 1) * DIGEST]


@dataclass(frozen=True, slots=True)
class Manifest:
    """A checkpoint: named trees of entries plus bookkeeping.

    `created` is unix seconds; `bytes_total` the logical bytes of all regular files;
    `bytes_new` the chunk bytes this commit wrote (what dedup did not find already stored).
    """

    id: str
    parent: str | None
    created: float
    bytes_total: int
    bytes_new: int
    meta: dict[str, Any] = field(default_factory=dict)
    trees: dict[str, tuple[Entry, ...]] = field(default_factory=dict)

    def digests(self) -> set[bytes]:
        """The distinct chunk digests this checkpoint references."""
        blob = b"".join(e.chunks for entries in self.trees.values() for e in entries)
        return set(np.frombuffer(blob, f"V{DIGEST}").tolist())


def encode(m: Manifest) -> bytes:
    """Serialise `m` (see the module docstring for the layout)."""
    trees = {
        name: [
            [e.path, e.kind, e.mode, e.uid, e.gid, e.mtime_ns, e.size, e.chunk_size, e.target, list(e.rdev),
             [[k, v.hex()] for k, v in e.xattrs]]
            for e in entries
        ]
        for name, entries in m.trees.items()
    }
    header = json.dumps(
        {"id": m.id, "parent": m.parent, "created": m.created, "bytes_total": m.bytes_total,
         "bytes_new": m.bytes_new, "meta": m.meta, "trees": trees},
        separators=(",", ":"),
    ).encode("ascii")
    body = b"".join([MAGIC, struct.pack("<I", len(header)), header, *(e.chunks for t in m.trees.values() for e in t)])
    return body + blake3(body).digest()


def decode(data: bytes, source: str = "manifest") -> Manifest:
    """Parse and check a serialised manifest; `source` names it in errors."""
    if len(data) < len(MAGIC) + 4 + DIGEST or not data.startswith(MAGIC):
        raise CorruptStoreError(f"{source}: not a k3sys manifest ({len(data)} bytes)")
    body, check = data[:-DIGEST], data[-DIGEST:]
    if blake3(body).digest() != check:
        raise CorruptStoreError(f"{source}: checksum mismatch (the file is damaged)")
    (n,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        h = json.loads(body[start : start + n])
        pos = start + n
        trees: dict[str, tuple[Entry, ...]] = {}
        for name, rows in h["trees"].items():
            entries = []
            for path, kind, mode, uid, gid, mtime_ns, size, chunk_size, target, rdev, xattrs in rows:
                if kind not in KINDS:
                    raise ValueError(f"unknown kind {kind!r}")
                n_bytes = -(-size // chunk_size) * DIGEST if chunk_size else 0
                entries.append(Entry(path, kind, mode, uid, gid, mtime_ns, size, chunk_size, body[pos : pos + n_bytes],
                                     target, (rdev[0], rdev[1]), tuple((k, bytes.fromhex(v)) for k, v in xattrs)))
                pos += n_bytes
            trees[name] = tuple(entries)
        if pos != len(body):
            raise ValueError(f"digest area holds {len(body) - start - n} bytes, entries need {pos - start - n}")
        return Manifest(h["id"], h["parent"], h["created"], h["bytes_total"], h["bytes_new"], h["meta"], trees)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptStoreError(f"{source}: malformed manifest ({e})") from e
