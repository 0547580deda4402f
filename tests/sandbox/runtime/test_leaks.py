"""Nothing leaks after kill: processes, mounts, cgroups, runc state, layers and staging are gone."""

from __future__ import annotations

import pytest
from waiting import wait_until

from k3sys.sandbox import Runtime, Sandbox, SandboxError

pytestmark = pytest.mark.timeout(120)


def test_kill_in_every_state_leaves_nothing(private_root, leak_check):
    with Runtime(private_root) as rt:
        src = Sandbox.create(runtime=rt)
        src.commands.run("sleep 1000 >/dev/null 2>&1 &")
        bg = src.commands.run("sleep 1000", background=True)
        kids = src.fork(2)
        kids[0].pause()
        kids[1].hibernate()
        restored = Sandbox.restore(src.checkpoint(), runtime=rt)
        ids = {s.id for s in (src, *kids, restored)}
        assert {s.state for s in Sandbox.list(runtime=rt)} == {"running", "paused", "hibernated"}
        for s in (src, *kids, restored):
            s.kill()
        with pytest.raises(SandboxError):  # the background command died with its sandbox
            bg.wait(10)
        assert Sandbox.list(runtime=rt) == []
        assert leak_check(private_root, ids) == []
        assert list((private_root / "layers").iterdir()) == []
        # Image directories are deleted on the runtime's cleanup thread: give it a moment.
        wait_until(lambda: not rt.scratch.exists() or not any(rt.scratch.iterdir()), 10, "scratch emptied", step=0.05)
        # Checkpoints are not sandboxes: they stay until deleted, and deleting them frees the store.
        for ck in rt.checkpoints():
            rt.delete_checkpoint(ck.id)
        assert rt.store.stats()["packs"] == 0
