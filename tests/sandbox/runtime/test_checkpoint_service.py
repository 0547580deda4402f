"""The checkpoint service (checkpoints.py) constructed alone, with the parts it is given and a driver
without runc (fake_driver.py): no `Runtime`, no reaper, no background hibernations. What its
operations leave in the sandbox table (through `SandboxTable.transition`), the store and the layer set."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_driver import FakeDriver

from k3sys.sandbox.errors import InvalidStateError
from k3sys.sandbox.runtime.catalog import Catalog
from k3sys.sandbox.runtime.checkpoints import CheckpointService
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.prefetch import Prefetcher
from k3sys.sandbox.runtime.reclaim import Reclaimer
from k3sys.sandbox.runtime.staging import Staging
from k3sys.sandbox.runtime.state import Record, State
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.spec import SandboxSpec


@dataclass
class Parts:
    table: SandboxTable
    layers: LayerSet
    store: Store
    staging: Staging
    reclaimer: Reclaimer
    service: CheckpointService
    driver: FakeDriver

    def start(self) -> str:
        """A running sandbox, as the life cycle's `create` leaves one (without the life-cycle part)."""
        sid = self.table.claim_id(None)
        rec = Record(sid, SandboxSpec(), State.CREATING, time.time())
        self.table.register(rec)
        with self.table.locked(sid):
            self.driver.create(sid, self.table.dirs(sid), rec.spec, [])
            self.table.set(rec, State.RUNNING)
        return sid

    def state(self, sid: str) -> tuple[str, str | None, str | None]:
        rec = self.table.get(sid)
        assert rec is not None
        return rec.state.value, rec.prev, rec.pending


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "sys" / "templates" / "busybox" / "rootfs").mkdir(parents=True)
    monkeypatch.setenv("K3SYS_SYSTEM_DIR", str(tmp_path / "sys"))
    root = tmp_path / "rt"
    for d in ("sandboxes", "layers", "tmp"):
        (root / d).mkdir(parents=True)
    store = Store(root / "store")
    layer_set = LayerSet(root / "layers", root / "tmp", lambda ck, dest: store.checkout(ck, {"fs": dest}))
    table = SandboxTable(root, layer_set)
    staging = Staging(root, tmp_path / "shm")
    driver = FakeDriver()
    catalog = Catalog(table, store, layer_set)
    prefetcher = Prefetcher(table, layer_set, store, staging)
    reclaimer = Reclaimer(table, driver, prefetcher, catalog)
    service = CheckpointService(table, layer_set, store, driver, staging, prefetcher, catalog, reclaimer)
    yield Parts(table, layer_set, store, staging, reclaimer, service, driver)
    staging.close()


def test_checkpoint_is_a_transition_through_checkpointing(parts: Parts):
    sid = parts.start()
    seen = []
    snapshot = parts.driver.snapshot

    def watching(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the driver's own arguments
        seen.append(parts.state(sid))
        return snapshot(*args, **kwargs)

    parts.driver.snapshot = watching  # type: ignore[method-assign]
    ck = parts.service.checkpoint(sid)
    assert seen == [("checkpointing", State.RUNNING, ck.id)]
    assert parts.state(sid) == ("running", None, None) and parts.table.get(sid).head == ck.id
    assert [m.id for m in parts.store.list()] == [ck.id] and parts.layers.counts() == {}


def test_a_failed_snapshot_is_rolled_back_by_the_transition(parts: Parts):
    sid = parts.start()
    with parts.table.locked(sid) as rec:
        parts.table.set(rec, State.PAUSED)
    parts.driver.fail_snapshot = True
    with pytest.raises(OSError, match="injected"):
        parts.service.hibernate(sid)
    assert parts.state(sid) == ("paused", None, None) and parts.table.get(sid).head is None
    assert parts.store.list() == [] and list((parts.table.root / "tmp").iterdir()) == []


def test_hibernate_then_spawn_and_discard_count_the_layer(parts: Parts):
    sid = parts.start()
    parts.driver.write(sid, parts.table.dirs(sid), "f", "one")
    ck = parts.service.hibernate(sid)
    assert parts.state(sid) == ("hibernated", None, None)
    assert parts.layers.counts() == {ck.id: 1}  # the hibernated record holds the layer it resumes onto
    with pytest.raises(InvalidStateError, match="hibernated"):  # the transition table refuses it
        parts.service.checkpoint(sid)
    kid = parts.service.spawn(SandboxSpec(), ck.id, ck.id, 0).id
    assert parts.driver.read(kid, parts.table.dirs(kid), "f") == "one"
    assert parts.layers.counts() == {ck.id: 2}
    for s in (kid, sid):
        with parts.table.locked(s) as rec:
            parts.reclaimer.discard(rec)
    assert parts.layers.counts() == {} and list((parts.table.root / "layers").iterdir()) == []
    assert [m.id for m in parts.store.list()] == [ck.id]  # the caller's checkpoint is kept
