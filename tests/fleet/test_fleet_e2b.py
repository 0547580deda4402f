"""The official `e2b` SDK (unchanged) against the gateway, exactly as against one service: sandboxes
land on every node, and commands, files, pause (= hibernate) -> connect, snapshots, fork and kill all
reach the right node."""

from __future__ import annotations

import pytest
from waiting import wait_until

e2b = pytest.importorskip("e2b", reason="the official e2b SDK is a dev dependency")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def e2b_env(gateway, monkeypatch):
    for k, v in {"E2B_API_URL": gateway, "E2B_SANDBOX_URL": gateway, "E2B_API_KEY": "e2b-fleet-test"}.items():
        monkeypatch.setenv(k, v)


def test_e2b_sdk_through_the_gateway(fleet, e2b_env):
    from e2b import Sandbox

    boxes = [Sandbox.create("base", timeout=240) for _ in range(3)]
    made = [b.sandbox_id for b in boxes]
    try:
        assert sorted(fleet.node_of(b.sandbox_id) for b in boxes) == ["n0", "n1", "n2"]
        for b in boxes:
            assert b.commands.run(f"echo {b.sandbox_id}").stdout == f"{b.sandbox_id}\n"
        b = boxes[1]
        b.files.write("/tmp/dir/t.txt", "fleet")
        assert b.files.read("/tmp/dir/t.txt") == "fleet"
        assert b.commands.run("cat /tmp/dir/t.txt").stdout == "fleet"
        b.files.make_dir("/tmp/w")
        w = b.files.watch_dir("/tmp/w")  # a watch the node keeps, drained through the gateway
        b.files.write("/tmp/w/f.txt", "x")
        names: set[str] = set()
        wait_until(lambda: names.update(e.name for e in w.get_new_events()) or "f.txt" in names, 20,
                   "the watch's event of f.txt", step=0.1)
        w.stop()
        h = b.commands.run("i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.05; done", background=True)
        assert h.pid > 0

        def count(sbx) -> int:  # `>` truncates before echo writes: a read (or a dump) may fall between
            return int(sbx.commands.run("cat /tmp/c 2>/dev/null || true").stdout or 0)
        wait_until(lambda: count(b) > 0, 20, "the counter's first write", step=0.1)
        assert b.pause() is True
        assert fleet.info(b.sandbox_id).state == "hibernated"
        back = Sandbox.connect(b.sandbox_id, timeout=240)
        before = wait_until(lambda: count(back), 20, "the counter read after the resume", step=0.1)
        wait_until(lambda: count(back) > before, 20, "the restored loop counting on", step=0.1)
        snap = back.create_snapshot()
        copy = Sandbox.create(snap.snapshot_id, timeout=120)
        made.append(copy.sandbox_id)
        assert copy.files.read("/tmp/dir/t.txt") == "fleet"
        kids = back.fork(count=2, timeout=120)
        made += [k.sandbox_id for k in kids]
        for k in kids:
            assert k.files.read("/tmp/dir/t.txt") == "fleet"
        listed = {i.sandbox_id for i in Sandbox.list().next_items()}
        assert set(made) <= listed
    finally:
        for sid in made:
            Sandbox.kill(sid)
    assert not {i.sandbox_id for i in Sandbox.list().next_items()} & set(made)
