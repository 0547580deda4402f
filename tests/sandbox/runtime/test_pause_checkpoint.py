"""E2B's pause keeps its checkpoint as the sandbox's own (issue 28, mismatch 4): not listed among
checkpoints, dropped when a newer hibernation of the sandbox commits and when the sandbox is
killed; an explicit `hibernate()` or `checkpoint()` is the caller's, listed and kept."""

from __future__ import annotations

import pytest
from counting import wait_for

from k3sys.sandbox import CheckpointNotFoundError, Runtime
from k3sys.sandbox.spec import SandboxSpec

pytestmark = pytest.mark.timeout(300)


def paused_to_hibernation(rt: Runtime, sid: str) -> str:
    """E2B's pause of running `sid`, waited for until hibernated; returns its checkpoint id."""
    rt.pause(sid, hibernate=True)
    wait_for(lambda: rt.info(sid).state == "hibernated", timeout=60, step=0.01)
    return rt.info(sid).head


def stored(rt: Runtime, ck: str) -> bool:
    try:
        rt.get_checkpoint(ck)
        return True
    except CheckpointNotFoundError:
        return False


def test_pause_checkpoints_are_the_sandboxes_own(private_root, leak_check):
    with Runtime(private_root, hibernate_delay_s=0.0) as rt:
        sid = rt.create(SandboxSpec(memory_mb=64, disk_mb=64)).id
        rt.run(sid, "echo one > /root/f")
        user = rt.checkpoint(sid).id
        listed = lambda: [c.id for c in rt.checkpoints()]  # noqa: E731

        first = paused_to_hibernation(rt, sid)
        assert stored(rt, first) and listed() == [user]  # the pause's: resumable from, not listed
        rt.resume(sid)
        assert rt.run(sid, "cat /root/f").stdout == "one\n"
        second = paused_to_hibernation(rt, sid)
        assert not stored(rt, first) and stored(rt, second) and listed() == [user]  # superseded: gone

        rt.resume(sid)
        mine = rt.hibernate(sid).id  # the caller's: listed, and it supersedes the pause's
        assert listed() == [user, mine] and not stored(rt, second)
        rt.resume(sid)
        third = paused_to_hibernation(rt, sid)
        assert listed() == [user, mine] and stored(rt, third)

        rt.resume(sid)
        rt.run(sid, "echo two > /root/f")
        kid = rt.restore(mine).id  # stands on the caller's checkpoint, unaffected by what follows
        rt.kill(sid)
        assert not stored(rt, third) and listed() == [user, mine]  # killed: its own went with it
        assert rt.run(kid, "cat /root/f").stdout == "one\n"
        rt.kill(kid)
        for ck in (user, mine):
            rt.delete_checkpoint(ck)
        assert rt.store.stats()["manifests"] == 0 and rt.store.stats()["packs"] == 0
        assert rt.store.verify() == []
    assert leak_check(private_root, {sid, kid}) == []
    assert list((private_root / "layers").iterdir()) == []
