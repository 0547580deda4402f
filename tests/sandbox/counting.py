"""Helpers the sandbox tests of several rooms share (runtime/, service/): a counter whose log proves a
process kept its memory and descriptors, and waiting on conditions. A module of its own (not a test
module) so that any test imports it by name, whichever folders a run collects."""

from __future__ import annotations

import os
from pathlib import Path

from waiting import wait_until

from k3sys.sandbox import Sandbox

wait_for = wait_until  # the older name, which tests still import from here

# A counter held in the shell's memory, written through a descriptor opened once: the log must read
# 1, 2, 3, ... with no gap and no restart after any operation, which only holds if memory (i), the
# descriptor's file offset and the file's content were all captured at the same instant.
COUNTER = ("sh -c 'echo $$ > /tmp/counter.pid; exec 3>/tmp/log; i=0; "
           "while :; do i=$((i+1)); echo $i >&3; sleep 0.02; done' >/dev/null 2>&1 &")


def log_lines(s: Sandbox) -> list[int]:
    """The counter's log ([] until the freshly started counter has created it)."""
    if not s.files.exists("/tmp/log"):
        return []
    return [int(x) for x in s.files.read_text("/tmp/log").split()]


def assert_counting(s: Sandbox, since: int = 0) -> list[int]:
    """The log is 1..n with nothing missing, and it is still growing past `since`."""
    def grown() -> list[int]:
        got = log_lines(s)
        return got if got and got[-1] > since + 2 else []

    got = wait_until(grown, 10, f"the counter going past {since}")
    assert got == list(range(1, len(got) + 1)), f"log has gaps or restarts: {got[:5]}...{got[-5:]}"
    return got


def criu_running(root: Path) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        args = cmd.split(b"\0")
        if b"checkpoint" in args and str(root).encode() in cmd:  # `runc --root <root>/runc checkpoint ...`
            return True
    return False
