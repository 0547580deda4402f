"""The runtime's checkpoint part over a driver without runc (fake_driver.py): what a checkpoint,
fork, restore, hibernation and kill leave in the store, the layer set and the sandbox table."""

from __future__ import annotations

import pytest
from counting import wait_for
from fake_driver import FakeDriver

from k3sys.sandbox import Runtime
from k3sys.sandbox.spec import SandboxSpec


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """(a Runtime over a FakeDriver, the driver), with a template directory of its own."""
    (tmp_path / "sys" / "templates" / "busybox" / "rootfs").mkdir(parents=True)
    (tmp_path / "shm").mkdir()
    monkeypatch.setenv("K3SYS_SYSTEM_DIR", str(tmp_path / "sys"))
    monkeypatch.setenv("K3SYS_SCRATCH", str(tmp_path / "shm"))
    driver = FakeDriver()
    with Runtime(tmp_path / "rt", driver=driver, hibernate_delay_s=0.0) as rt:
        yield rt, driver


def sees(rt: Runtime, driver: FakeDriver, sid: str, name: str) -> str:
    return driver.read(sid, rt.table.dirs(sid), name)


def test_checkpoint_fork_restore_kill_count_layers(fake):
    rt, driver = fake
    sid = rt.create(SandboxSpec()).id
    driver.write(sid, rt.table.dirs(sid), "f", "one")
    ck = rt.checkpoint(sid)
    assert [c.id for c in rt.checkpoints()] == [ck.id] and rt.info(sid).head == ck.id
    kids = [k.id for k in rt.fork(sid, 2)]
    restored = rt.restore(ck.id).id
    assert all(sees(rt, driver, k, "f") == "one" for k in [*kids, restored])
    counts = rt.layers.counts()
    assert counts[ck.id] == 1 and sorted(counts.values()) == [1, 2]  # the fork's layer: both children
    for k in kids:
        rt.kill(k)
    assert rt.layers.counts() == {ck.id: 1}
    rt.kill(restored)
    rt.kill(sid)
    assert rt.layers.counts() == {} and list((rt.root / "layers").iterdir()) == []
    assert [c.id for c in rt.checkpoints()] == [ck.id]  # the caller's checkpoint is kept


def test_pause_hibernation_is_the_sandboxes_own_and_resumes(fake):
    rt, driver = fake
    sid = rt.create(SandboxSpec()).id
    driver.write(sid, rt.table.dirs(sid), "f", "one")
    rt.pause(sid, hibernate=True)
    wait_for(lambda: rt.info(sid).state == "hibernated", timeout=30, step=0.01)
    head = rt.info(sid).head
    assert rt.checkpoints() == [] and rt.get_checkpoint(head).id == head
    assert rt.layers.counts() == {head: 1}  # the hibernated record holds the layer it resumes onto
    rt.resume(sid)
    assert rt.info(sid).state == "running" and sees(rt, driver, sid, "f") == "one"
    rt.kill(sid)
    assert rt.store.list() == [] and rt.layers.counts() == {}


def test_a_failed_snapshot_leaves_the_sandbox_as_it_was(fake):
    rt, driver = fake
    sid = rt.create(SandboxSpec()).id
    driver.fail_snapshot = True
    with pytest.raises(OSError, match="injected"):
        rt.checkpoint(sid)
    info = rt.info(sid)
    assert (info.state, info.head) == ("running", None) and rt.store.list() == []
    assert list((rt.root / "tmp").iterdir()) == []
    rt.kill(sid)
