"""Moving a checkpoint from one store to another (fleet nodes): its manifest, then only the chunks the
target lacks, each checked against its digest on arrival.

    data = export_manifest(source, ck)                  # on the node that has it
    imp = Importer(target, data)                        # on the node that wants it
    for batch in batches(imp.needed, limit):            # `imp.needed`: digests the target lacks
        imp.add(batch, read_chunks(source, ck, batch))  # bytes back to back, verified here
    m = imp.finish()                                    # one new pack, then the manifest (durably)

The target trusts nothing it is sent: the manifest is decoded with its own checksum, every chunk is
hashed and compared with the digest the manifest names, lengths come from the manifest (never from
the sender), and the manifest is published only once every chunk it names is stored, so a transfer
cut at any point leaves the target's earlier checkpoints as they were and no half checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
from blake3 import blake3

from k3sys.sandbox.errors import CheckpointNotFoundError, CorruptStoreError, StoreInputError
from k3sys.sandbox.runtime.store import chunker
from k3sys.sandbox.runtime.store.catalog import check_name
from k3sys.sandbox.runtime.store.manifest import Manifest, decode, encode
from k3sys.sandbox.runtime.store.store import Store


def export_manifest(store: Store, ck: str) -> bytes:
    """Checkpoint `ck`'s manifest in its on-disk encoding (checksummed)."""
    return encode(store.get(ck))


def chunk_lengths(m: Manifest) -> dict[bytes, int]:
    """Every chunk `m` names -> its length in bytes (the last chunk of a file may be short)."""
    out: dict[bytes, int] = {}
    for entries in m.trees.values():
        for e in entries:
            for i, d in enumerate(chunker.split(e.chunks)):
                out[d] = min(e.chunk_size, e.size - i * e.chunk_size)
    return out


def read_chunks(store: Store, ck: str, digests: list[bytes]) -> bytes:
    """The bytes of `digests` (chunks of checkpoint `ck`, which pins them) back to back."""
    lengths = chunk_lengths(store.get(ck))
    unknown = [d for d in digests if d not in lengths]
    if unknown:
        raise StoreInputError(f"checkpoint {ck!r} has no chunk {unknown[0].hex()}")
    out = bytearray(sum(lengths[d] for d in digests))
    cat = store.catalog
    with cat.flock(exclusive=False):
        with cat.mu:
            cat.refresh()
            pack, off = cat.index.locate(b"".join(digests))
            paths = {int(p): cat.index.packs[int(p)].path for p in set(pack.tolist()) if p >= 0}
        if (pack < 0).any():
            raise CorruptStoreError(f"checkpoint {ck!r}: chunk {digests[int(np.argmax(pack < 0))].hex()} missing")
        fds = {p: os.open(path, os.O_RDONLY | os.O_CLOEXEC) for p, path in paths.items()}
        try:
            at = 0
            for d, p, o in zip(digests, pack.tolist(), off.tolist(), strict=True):
                n = lengths[d]
                if os.preadv(fds[p], [memoryview(out)[at : at + n]], o) != n:
                    raise CorruptStoreError(f"checkpoint {ck!r}: a pack is truncated at {o}")
                at += n
        finally:
            for fd in fds.values():
                os.close(fd)
    return bytes(out)


def batches(digests: list[bytes], lengths: dict[bytes, int], limit: int) -> Iterator[list[bytes]]:
    """`digests` in order, cut into lists of at most `limit` bytes of chunks (at least one chunk each)."""
    batch: list[bytes] = []
    size = 0
    for d in digests:
        if batch and size + lengths[d] > limit:
            yield batch
            batch, size = [], 0
        batch.append(d)
        size += lengths[d]
    if batch:
        yield batch


class Importer:
    """Receives one checkpoint into `store` (see the module docstring). Not thread-safe: one per transfer."""

    def __init__(self, store: Store, manifest: bytes) -> None:
        """`manifest`: `export_manifest`'s bytes, from the sender."""
        self.store = store
        self.manifest = decode(manifest, "transferred manifest")
        check_name("checkpoint id", self.manifest.id)
        self.lengths = chunk_lengths(self.manifest)
        self.exists = self._stored()
        # Sorted: the sender reads them in this order, and two transfers of one family ask alike.
        self.needed: list[bytes] = [] if self.exists else sorted(store.catalog.index.missing(set(self.lengths)))
        self.received = 0  # bytes of chunk data taken in
        self._name, self._writer = store.catalog.new_pack()

    def _stored(self) -> bool:
        try:
            self.store.get(self.manifest.id)
        except CheckpointNotFoundError:
            return False
        return True

    def add(self, digests: list[bytes], data: bytes) -> None:
        """Take the chunks `digests` (all of them named by the manifest), their bytes back to back in `data`."""
        want = [self.lengths.get(d, -1) for d in digests]
        if -1 in want:
            raise StoreInputError(f"chunk {digests[want.index(-1)].hex()} is not in checkpoint {self.manifest.id!r}")
        if sum(want) != len(data):
            raise StoreInputError(f"expected {sum(want)} bytes for {len(digests)} chunks, got {len(data)}")
        buf = np.frombuffer(data, np.uint8)
        at, i = 0, 0
        while i < len(digests):  # runs of equal length: one hash call and one pack row run each
            j = i + 1
            while j < len(digests) and want[j] == want[i]:
                j += 1
            n = want[i] * (j - i)
            run = buf[at : at + n]
            # digest_chunks reads 8-byte words; a file's short tail chunk is hashed on its own.
            got = (chunker.digest_chunks(run, want[i]) if want[i] % 8 == 0
                   else [blake3(run[k : k + want[i]]).digest() for k in range(0, n, want[i])])
            bad = [k for k, (a, b) in enumerate(zip(got, digests[i:j], strict=True)) if a != b]
            if bad:
                raise CorruptStoreError(f"chunk {digests[i + bad[0]].hex()} arrived with other bytes")
            self._writer.add(digests[i:j], buf[at : at + n], want[i])
            at, i = at + n, j
        self._writer.flush()
        self.received += len(data)

    def finish(self) -> Manifest:
        """Make the new chunks durable, then publish the manifest; returns it (the stored one if it
        was there already)."""
        cat, m = self.store.catalog, self.manifest
        if self.exists:
            self._writer.abort()
            return cat.get(m.id)
        tmp = cat.temp_manifest(m.id)
        try:
            with cat.flock(exclusive=False):
                if self._writer.rows:
                    cat.publish_pack(self._writer, self._name)
                lacking = cat.index.missing(set(self.lengths))
                if lacking:
                    raise StoreInputError(f"checkpoint {m.id!r}: {len(lacking)} chunks never arrived "
                                          f"(e.g. {next(iter(lacking)).hex()[:16]})")
                cat.publish_manifest(m, tmp)
        finally:
            self._writer.abort()
            if os.path.exists(tmp):
                os.unlink(tmp)
        return m

    def abort(self) -> None:
        """Drop what arrived (idempotent)."""
        self._writer.abort()

