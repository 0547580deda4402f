"""Checkpoints of sandboxes: snapshot (CRIU images on tmpfs + the sealed file system), commit to
the store, hibernate, restore, fork. The store's checkpoints as listed and deleted, and what a sealed
layer holds of a sandbox's disk: catalog.py; images staged for a coming resume: prefetch.py.

A snapshot freezes the sandbox, dumps it and (checkpoint, fork) thaws it at once; the store packs the
memory images while CRIU writes them (`Store.follow`). A fork stores nothing: its images and sealed
fs live only as long as its children need them. Each operation is a `SandboxTable.transition`, so a
failure leaves the sandbox in its previous state.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3sys.sandbox.errors import SandboxError
from k3sys.sandbox.runtime import layers
from k3sys.sandbox.runtime.background import Cancelled, Job
from k3sys.sandbox.runtime.catalog import FS_BYTES, INTERNAL, Catalog
from k3sys.sandbox.runtime.drivers.base import Driver, Images
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.prefetch import Prefetcher
from k3sys.sandbox.runtime.reclaim import Reclaimer
from k3sys.sandbox.runtime.staging import Staging
from k3sys.sandbox.runtime.state import LIVE, Record, State
from k3sys.sandbox.runtime.store import Follower, Manifest, Store
from k3sys.sandbox.runtime.store.reader import FileReader
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.templates import template_rootfs
from k3sys.sandbox.runtime.trees import new_id, remove_tree
from k3sys.sandbox.spec import MAX_FORK, SandboxSpec, check_number
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo


@dataclass(frozen=True)
class Snapshot:
    """A sandbox's state captured in staging: checkpoint id, image and sealed-fs directories, timings
    (seconds per phase), and the store follower already packing the images."""

    ck: str
    images: Path
    fs: Path
    t: dict[str, float]
    follower: Follower | None

    def abandon(self) -> None:
        """Drop what the snapshot staged (it is not to be committed)."""
        if self.follower is not None:
            self.follower.abort()
        remove_tree(self.images)
        remove_tree(self.fs)


class CheckpointService:
    """Checkpoint, hibernate, restore and fork the sandboxes of `table` (see the module docstring)."""

    def __init__(self, table: SandboxTable, layer_set: LayerSet, store: Store, driver: Driver, staging: Staging,
                 prefetcher: Prefetcher, catalog: Catalog, reclaimer: Reclaimer) -> None:
        self.table = table
        self.layers = layer_set
        self.store = store
        self.driver = driver
        self.staging = staging
        self.prefetcher = prefetcher
        self.catalog = catalog
        self.reclaimer = reclaimer

    def _snapshot(self, rec: Record, *, thaw: bool, store: bool = True) -> Snapshot:
        """Freeze-consistent images + sealed fs of a live sandbox (in a transitional state) into
        staging; the record's `pending` says its checkpoint id. With `store`, the store packs the memory
        images while CRIU writes them (`Store.follow`); `_commit` finishes that, and a caller that does
        not commit must `abandon` the snapshot."""
        ck = new_id("ck")
        images, fs = self.staging.new(ck)
        self.table.set(rec, rec.state, pending=ck)
        follower = self.store.follow(images) if store else None
        snap = Snapshot(ck, images, fs, {}, follower)
        try:
            snap.t.update(self.driver.snapshot(rec.id, self.table.dirs(rec.id), images, fs,
                                               self.layers.path(rec.layer) if rec.layer else None, thaw=thaw))
        except BaseException:
            snap.abandon()
            raise
        return snap

    def _commit(self, rec: Record, snap: Snapshot, internal: bool = False,
                extra: dict[str, Any] | None = None) -> Manifest:
        """Commit `snap` as the sandbox's next checkpoint, with what its sealed fs holds of a disk
        (`FS_BYTES`) and `extra` in its meta; `internal`: the sandbox's own (`INTERNAL`)."""
        t0 = time.perf_counter()  # "measure", within "store"
        meta = {**(extra or {}), "sandbox": rec.id, "spec": rec.spec.to_json(), FS_BYTES: layers.tree_bytes(snap.fs)}
        if internal:
            meta[INTERNAL] = True
        snap.t["measure"] = time.perf_counter() - t0
        return self.store.commit({"images": snap.images, "fs": snap.fs}, parent=rec.head, meta=meta,
                                 id=snap.ck, follower=snap.follower)

    def checkpoint(self, sid: str, meta: dict[str, Any] | None = None) -> CheckpointInfo:
        """Snapshot a running or paused sandbox into the store; the sandbox carries on as it was.
        `meta`: added to the checkpoint's manifest (a warm template's marks: warm.py)."""
        with self.table.locked(sid):
            t0 = time.perf_counter()
            with self.table.transition(sid, LIVE, State.CHECKPOINTING, None, "checkpoint") as rec:
                snap = self._snapshot(rec, thaw=True)
            try:  # the sandbox runs again already; a failed commit only loses this checkpoint
                t1 = time.perf_counter()
                m = self._commit(rec, snap, extra=meta)
                snap.t["store"] = time.perf_counter() - t1
            except BaseException:
                snap.abandon()
                self.table.set(rec, rec.state, pending=None)
                raise
            self.table.set(rec, rec.state, head=snap.ck, pending=None)
            snap.t["total"] = time.perf_counter() - t0
            self.table.timings[sid] = snap.t
            self.staging.discard(snap.images)
            remove_tree(snap.fs)
            return CheckpointInfo.from_manifest(m, snap.t)

    def hibernate(self, sid: str, job: Job | None = None, internal: bool = False) -> CheckpointInfo:
        """Checkpoint a running or paused sandbox, then stop every process (memory and CPU released;
        `resume` brings it back); returns once the checkpoint is durable. `internal`: the checkpoint is
        the sandbox's own (`Record.hibernation`, replacing the one before). For a background `job`
        cancelled meanwhile (a `resume` or `kill` waits for the lock), stop after the phase in progress
        instead and raise `Cancelled`, leaving the sandbox paused: after the dump its images are
        dropped; after the commit the checkpoint is kept as its head."""
        t0 = time.perf_counter()
        with self.table.transition(sid, LIVE, State.HIBERNATING, State.HIBERNATED, "hibernate") as rec:
            # Frozen, not killed, until the checkpoint is durable: a failure can still roll back.
            snap = self._snapshot(rec, thaw=False)
            t = snap.t
            try:
                if job is not None and job.cancelled:
                    raise Cancelled(f"hibernation of {sid} cancelled after its dump")
                t1 = time.perf_counter()
                m = self._commit(rec, snap, internal)
                t["store"] = time.perf_counter() - t1
            except BaseException:
                snap.abandon()
                self._undo_hibernate(rec)
                self.table.set(rec, rec.state, then_hibernate=False)
                raise
            # Durable: the sandbox's head from here on whatever follows, so the pause's checkpoint before it goes.
            self.catalog.drop_own(rec.hibernation)
            own = snap.ck if internal else None
            if job is not None and job.cancelled:  # durable already: kept as its head
                self.staging.discard(snap.images)
                remove_tree(snap.fs)
                self._undo_hibernate(rec)
                self.table.set(rec, rec.state, head=snap.ck, then_hibernate=False, hibernation=own)
                raise Cancelled(f"hibernation of {sid} cancelled after its commit: {snap.ck} kept as a checkpoint")
            t1 = time.perf_counter()
            self.driver.destroy(sid, self.table.dirs(sid))
            self.reclaimer.wipe_upper(rec)
            t["stop"] = time.perf_counter() - t1
            self._warm(snap.ck, snap.images)  # before "hibernated": their tmpfs is freed too (~50 ms per GiB)
            self.table.set(rec, rec.state, head=snap.ck, layer=None, sealed_bytes=m.meta[FS_BYTES], pending=None,
                           then_hibernate=False, hibernation=own)
        # The sealed fs is exactly what `resume` will stack the new upper on: the layer the record now
        # holds (were this to fail, the resume would check it out of the store).
        self.layers.adopt(snap.ck, snap.fs)
        t["total"] = time.perf_counter() - t0
        self.table.timings[sid] = t
        return CheckpointInfo.from_manifest(m, t)

    def _undo_hibernate(self, rec: Record) -> None:
        """Put a sandbox whose hibernation stopped after its dump back as it was before (`rec.prev`):
        thawed if it ran, and its agent's gate open again (the dump left it closed)."""
        if rec.prev is State.RUNNING:
            self.driver.resume(rec.id)
        self.driver.agent(rec.id, self.table.dirs(rec.id)).open_gate()

    def restore_into(self, rec: Record, ck: str, images: Path | None = None, eager: bool = False
                     ) -> dict[str, float]:
        """Start `rec`'s processes (its lock held) from checkpoint `ck` (images from `prefetch` or the
        store unless given). From the store: every image but the memory pages' bytes, checked out while
        the driver mounts; it reads the pages by range from the packs (those CRIU restores itself first),
        behind the running processes unless `eager` (all memory back before they run)."""
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        layer = self.layers.ensure(ck)  # held by `rec` (its layer, or the head it resumes onto)
        own, reader = images is None, None
        staged = self.prefetcher.unstage(rec.id, keep=True) if own else None
        if staged is not None and staged.ck == ck:
            images = staged.path
        elif staged is not None:
            remove_tree(staged.path)
        pool = ThreadPoolExecutor(1, thread_name_prefix="k3sys-checkout")
        try:
            ready = self.driver.images.complete(images) if images is not None else None
            if ready is None:
                reader = FileReader(self.store, ck, "images")
                images, _ = self.staging.new(f"{ck}-{rec.id}")
                checkout = pool.submit(self.store.checkout, ck, {"images": images}, self.driver.images.holds_memory)

                def wait() -> None:  # "store": until the checkout is done (it runs beside the mounts)
                    checkout.result()
                    t["store"] = time.perf_counter() - t0

                ready = Images(images, self.driver.images.memory_bytes(reader.sizes()), wait, reader.read,
                               reader.prefetch)
            lowers = [layer, template_rootfs(rec.spec.template)]
            # Lazily where the images are ours: the sandbox runs while its memory streams in.
            t.update(self.driver.restore(rec.id, self.table.dirs(rec.id), rec.spec, lowers, ready,
                                         lazy=own and not eager, sealed_bytes=rec.sealed_bytes))
        finally:
            pool.shutdown()  # a restore that failed before waiting for the checkout lets it finish first
            if own and images is not None:
                self.staging.later(self._drop_images, rec.id, images, reader)
            elif reader is not None:
                reader.close()
        t["total"] = time.perf_counter() - t0
        self.table.timings[rec.id] = t
        return t

    def _warm(self, ck: str, images: Path) -> None:
        """Have the store start reading what a resume from hibernation `ck` reads first (~1 MiB; its
        packs are written past the page cache), then delete `images`. Best effort."""
        with contextlib.suppress(SandboxError, OSError), FileReader(self.store, ck, "images") as reader:
            for name, ranges in self.driver.images.first_reads(images).items():
                reader.prefetch(name, ranges)
        remove_tree(images)

    def _drop_images(self, sid: str, images: Path, reader: FileReader | None) -> None:
        """Delete the images `sid` was restored from (and let go of the packs its pages were read
        from), once a lazy restore no longer reads them."""
        try:
            self.driver.settle(sid)
        finally:
            remove_tree(images)
            if reader is not None:
                reader.close()

    def restore(self, ck: str, id: str | None = None, timeout_s: float | None = None,
                on_timeout: str | None = None) -> SandboxInfo:
        """A new running sandbox from checkpoint `ck` (its processes, memory and files); `timeout_s`
        and `on_timeout`, when given, replace those of the checkpoint's spec."""
        m = self.store.get(ck)
        spec = SandboxSpec.from_json(m.meta.get("spec", {}))
        changes = {k: v for k, v in (("timeout_s", timeout_s), ("on_timeout", on_timeout)) if v is not None}
        if changes:
            spec = SandboxSpec(**{**spec.to_json(), **changes})
        return self.spawn(spec, ck, ck, self.catalog.fs_bytes(ck), id)

    def spawn(self, spec: SandboxSpec, ck: str, head: str | None, sealed_bytes: int, id: str | None = None,
              images: Path | None = None, eager: bool = False) -> SandboxInfo:
        """A new sandbox restored from snapshot `ck` (its layer, holding `sealed_bytes` of its disk; its
        images from the store unless given), whose latest stored checkpoint is `head`; `eager`: see
        `restore_into`."""
        sid = self.table.claim_id(id)
        now = time.time()
        rec = Record(sid, spec, State.CREATING, now, deadline=now + spec.timeout_s if spec.timeout_s else None,
                     head=head, layer=ck, sealed_bytes=sealed_bytes)
        self.table.register(rec)
        with self.table.locked(sid):
            self.table.save(rec)
            try:
                self.restore_into(rec, ck, images, eager)
            except BaseException:
                self.reclaimer.discard(rec)
                raise
            self.table.set(rec, State.RUNNING)
            return self.table.info(rec)

    def fork(self, sid: str, n: int = 1) -> list[SandboxInfo]:
        """`n` new running sandboxes, each a copy of this one now (processes, memory, files).

        One snapshot serves all of them and nothing is stored: its images stay on tmpfs until the
        children are restored, and its sealed fs becomes their shared lower layer (kept while any of
        them stands on it). Each child's `head` is this sandbox's: the latest stored checkpoint it
        descends from. Checkpoint the source first to keep its state in the store.
        """
        check_number("n", n, 1, MAX_FORK, "children", integer=True)
        with self.table.locked(sid):
            t0 = time.perf_counter()
            with self.table.transition(sid, LIVE, State.CHECKPOINTING, None, "fork") as rec:
                snap = self._snapshot(rec, thaw=True, store=False)
            ck, t = snap.ck, snap.t
            kids: list[SandboxInfo] = []
            self.layers.acquire(ck)  # the fork's own hold on the new layer, until every child holds it
            try:
                layer = self.layers.adopt(ck, snap.fs)
                t1 = time.perf_counter()
                fs_bytes = layers.tree_bytes(layer)  # what each child's disk holds already
                t["measure"] = time.perf_counter() - t1
                private = [self._private_images(snap.images, i) for i in range(n)]  # before any child starts
                t1 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=min(n, 8)) as pool:
                    spawns = [pool.submit(self.spawn, rec.spec, ck, rec.head, fs_bytes, None, d) for d in private]
                    failures = []
                    for f in spawns:
                        try:
                            kids.append(f.result())
                        except Exception as e:
                            failures.append(e)
                    t["restore"] = time.perf_counter() - t1
                if failures:
                    raise failures[0]
            except BaseException:
                for kid in kids:
                    with contextlib.suppress(SandboxError), self.table.locked(kid.id) as kid_rec:
                        self.reclaimer.discard(kid_rec)
                raise
            finally:
                for d in snap.images.parent.glob(f"{snap.images.name}*"):
                    self.staging.discard(d)
                remove_tree(snap.fs)  # only there if it was not adopted
                self.table.set(rec, rec.state, pending=None)
                self.layers.release(ck)  # the layer goes unless a child stands on it
            t["total"] = time.perf_counter() - t0
            self.table.timings[sid] = t
            return kids

    @staticmethod
    def _private_images(images: Path, i: int) -> Path:
        """A hard-linked copy of the image directory: each concurrent CRIU restore writes its own
        stats file into the directory it restores from."""
        out = images.with_name(f"{images.name}.{i}")
        out.mkdir()
        for f in images.iterdir():
            os.link(f, out / f.name)
        return out
