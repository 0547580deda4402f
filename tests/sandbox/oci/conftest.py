"""Fixtures of the template builder's tests: a private system directory (its templates/ and
layers/ the test's own; bin/, etc/ and the built-in templates those of the real one), so imports
and builds never touch the host's templates."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3sys.sandbox.runtime.system import system_paths


@pytest.fixture
def system_dir(tmp_path, monkeypatch) -> Path:
    """A system directory of the test's own, set as K3SYS_SYSTEM_DIR for the test."""
    real = system_paths().root
    mine = tmp_path / "system"
    (mine / "templates").mkdir(parents=True)
    for d in ("bin", "etc", "build", "stamps"):
        if (real / d).exists():
            os.symlink(real / d, mine / d)
    for t in ("busybox", "debian", "base"):
        if (real / "templates" / t / "rootfs").is_dir():
            os.symlink((real / "templates" / t).resolve(), mine / "templates" / t)
    monkeypatch.setenv("K3SYS_SYSTEM_DIR", str(mine))
    return mine
