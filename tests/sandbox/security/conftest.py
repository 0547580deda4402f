"""The standing attack suite's fixtures: one embedded runtime for the folder (on a private 0700
directory, as a real one under ~root would be), a bystander sandbox that must keep working, and the
host state every attack must leave as it was (a canary file, a loop device of ours, the host's
descriptor table).

Every test calls `record_property("attack", ...)` and `record_property("figure", ...)`;
bench/sandbox_security.py turns those into the table attack / tried / held / figure.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_fixtures import MISSING, leftovers, loops_backed_by, scratch_runtime

from k3sys.sandbox.errors import NotFoundError

pytestmark = pytest.mark.timeout(180)


class Host:
    """Host state an attack must not change: a canary file and a loop device we attach, with their
    contents' hashes."""

    def __init__(self, work: Path) -> None:
        self.canary = work / "canary"
        self.canary.write_bytes(os.urandom(4096))
        image = work / "loop.img"
        image.write_bytes(os.urandom(1 << 20))
        self.loop = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True,
                                   check=True).stdout.strip()
        self.digest = self._digest()

    def _digest(self) -> str:
        with open(self.loop, "rb") as f:
            return hashlib.sha256(self.canary.read_bytes() + f.read()).hexdigest()

    def unchanged(self) -> bool:
        return self._digest() == self.digest

    def close(self) -> None:
        subprocess.run(["losetup", "-d", self.loop], check=False)


@pytest.fixture(scope="session")
def sec_rt() -> Iterator:
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    with scratch_runtime("k3sys-sec-") as runtime:  # under a private 0700 directory
        yield runtime


@pytest.fixture(scope="session")
def host(tmp_path_factory) -> Iterator[Host]:
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    h = Host(tmp_path_factory.mktemp("host"))
    yield h
    h.close()


@pytest.fixture(scope="session")
def debian_template() -> Path:
    """The `debian` template (python3 inside, for raw system calls), built once if missing."""
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    from k3sys.sandbox.runtime.templates import template_rootfs

    return template_rootfs("debian")


@pytest.fixture(scope="session")
def bystander(sec_rt):
    """A sandbox of the same runtime that every attack must leave working."""
    from k3sys.sandbox import Sandbox

    s = Sandbox.create(runtime=sec_rt, memory_mb=64)
    s.files.write("/root/mine", "bystander")
    yield s
    s.kill()


class Arena:
    """Sandboxes made for one attack; `finish` checks they die cleanly and nothing else changed."""

    def __init__(self, rt, host: Host, bystander) -> None:
        self.rt, self.host, self.bystander = rt, host, bystander
        self.made: list = []

    def create(self, **kw):
        from k3sys.sandbox import Sandbox

        s = Sandbox.create(runtime=self.rt, **kw)
        self.made.append(s)
        return s

    def track(self, sandboxes: list) -> None:
        self.made += sandboxes

    def finish(self) -> None:
        assert self.host.unchanged(), "the host's canary file or loop device changed"
        assert self.bystander.commands.run("cat /root/mine").stdout == "bystander"
        ids = {s.id for s in self.made}
        for s in self.made:
            with contextlib.suppress(NotFoundError):  # the test killed it already
                s.kill()
        driver = self.rt.driver
        # leftovers() lists what the whole runtime holds; the bystander's own entries are expected.
        held = [line for line in leftovers(self.rt.root, ids) if self.bystander.id not in line]
        assert held == []
        assert not [i for i in ids if (driver.reach.dir / i).exists()]
        assert loops_backed_by([self.rt.table.dirs(i).root for i in ids]) == []
        assert all(driver.ranges.base_of(self.rt.table.dirs(i).root) is None for i in ids)


@pytest.fixture
def arena(sec_rt, host, bystander) -> Iterator[Arena]:
    a = Arena(sec_rt, host, bystander)
    yield a
    a.finish()
