"""The sandbox part of `k3sys demo` runs end to end and reports its figures."""

from __future__ import annotations

import pytest
from rich.console import Console
from rich.progress import Progress

from k3sys.demo import PARTS
from k3sys.sandbox.demo import demo
from k3sys.sandbox.runtime.system import system_paths

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(system_paths().missing() is not None, reason=f"{system_paths().missing()}")
def test_demo_part_runs():
    assert ("Sandbox", "k3sys.sandbox.demo") in PARTS
    with Progress(console=Console(quiet=True)) as progress:
        rows = dict(demo(progress))
    assert rows["memory held while hibernated"] == "0 bytes"
    assert len(rows["forks counting on independently"].split(", ")) == 4
    assert rows["create (busybox, 512 MiB, loopback only)"].endswith(" ms")
