"""Helpers of the fleet's tests: sandboxes running a counter, to show a process runs on across moves."""

from __future__ import annotations

import os
import time

from waiting import wait_until

from k3sys.sandbox.spec import SandboxSpec

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.05; done"


def count(fleet, sid: str) -> int:
    return int(wait_until(lambda: fleet.run(sid, "cat /tmp/c 2>/dev/null").stdout.strip(), 10, f"a counter in {sid}",
                          step=0.05))


def runs_on(fleet, sid: str, after: int) -> int:
    """The counter of `sid` now, checked to have gone on from `after` (no restart from 0)."""
    now = count(fleet, sid)
    assert now >= after, (sid, after, now)
    wait_until(lambda: count(fleet, sid) > now, 10, f"the counter of {sid} going past {now}", step=0.05)
    return now


def counting_sandbox(fleet, node: str, payload_mb: int = 0) -> str:
    sid = fleet.create(SandboxSpec(memory_mb=128), node=node).id
    fleet.start_command(sid, COUNTER)
    if payload_mb:
        fleet.write_file(sid, "/payload.bin", os.urandom(payload_mb << 20))
    count(fleet, sid)
    return sid


def settled_reserved(fleet, timeout: float = 30.0) -> dict[str, int]:
    """Each node's reserved MiB once the nodes' views stop moving: what earlier tests killed or
    hibernated reaches the views a heartbeat later, and placement ranks by the views."""
    last: dict[str, int] | None = None
    deadline = time.monotonic() + timeout
    while True:
        now = {m.name: m.view.reserved_mb for m in fleet.members.live() if m.name in ("n0", "n1", "n2")}
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(3 * fleet.config.heartbeat_s)
