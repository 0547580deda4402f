"""Sandboxes that share sealed layers, restored, forked and killed from many threads at once
(issue 28): no layer is deleted twice (a warning) or under a sandbox that stands on it, and none
is left once no sandbox stands on it, whatever checkpoints the store keeps (layerset.py)."""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest

from k3sys.sandbox import Runtime
from k3sys.sandbox.spec import SandboxSpec

THREADS = 20
# Seconds of restores, forks and kills (the 60 by default; K3SYS_LAYER_RACE_S for a quick run).
DURATION_S = float(os.environ.get("K3SYS_LAYER_RACE_S", "60"))
MAX_OWN = 3  # sandboxes one thread holds at most (20 threads: up to 60 live sandboxes)

pytestmark = pytest.mark.timeout(DURATION_S + 600)


def assert_stands(rt: Runtime, sid: str) -> None:
    """`sid` runs a command and reads the file its sealed layer holds (a layer deleted under it
    would have taken the file with it)."""
    assert rt.run(sid, "cat /marker").stdout == "shared\n"


def test_restore_fork_kill_race_on_shared_layers(private_root, leak_check, caplog):
    caplog.set_level(logging.WARNING, logger="k3sys.sandbox")
    with Runtime(private_root) as rt:
        src = rt.create(SandboxSpec(memory_mb=64, disk_mb=64)).id
        rt.run(src, "echo shared > /marker")
        ck = rt.checkpoint(src).id
        rt.kill(src)
        stop = time.monotonic() + DURATION_S
        errors: list[BaseException] = []
        made: set[str] = set()
        counts = {"restore": 0, "fork": 0, "kill": 0}

        def worker(seed: int) -> None:
            rnd = random.Random(seed)
            own: list[str] = []
            try:
                while time.monotonic() < stop:
                    r, new = rnd.random(), []
                    if len(own) >= MAX_OWN or (own and r < 0.35):
                        rt.kill(own.pop(rnd.randrange(len(own))))
                        counts["kill"] += 1
                    elif not own or r < 0.7:
                        new = [rt.restore(ck).id]
                        counts["restore"] += 1
                    else:
                        new = [k.id for k in rt.fork(rnd.choice(own), n=rnd.choice((1, 2)))]
                        counts["fork"] += 1
                    for sid in new:
                        made.add(sid)
                        own.append(sid)
                        assert_stands(rt, sid)
                for sid in own:  # every sandbox still standing has its layer
                    assert_stands(rt, sid)
                    rt.kill(sid)
            except BaseException as e:  # collected and raised in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise AssertionError(f"{len(errors)} threads failed: {[repr(e) for e in errors]}") from errors[0]
        # Before layerset.py: "cannot remove .../layers/ck-...: No such file or directory" (two kills).
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert counts["restore"] > THREADS and counts["fork"] > 0 and counts["kill"] > THREADS, counts
        assert rt.list() == []
        # No sandbox stands on a layer: none is left, though checkpoint `ck` is kept in the store.
        assert rt.layers.counts() == {}
        assert list((private_root / "layers").iterdir()) == []
        rt.delete_checkpoint(ck)
    assert leak_check(private_root, made) == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
