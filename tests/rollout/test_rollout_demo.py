"""The demo's Rollout part, shrunk (1 group of 2, 2 turns, 4 tokens a turn): its rows and its report."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress

import k3sys.rollout.demo as rollout_demo

pytestmark = [pytest.mark.timeout(180), pytest.mark.embedded]


def test_rollout_demo_part(rt, debian, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("k3sys.sandbox.sdk.connection._default", rt)  # the demo's sandboxes on the test's runtime
    for name, value in (("EPISODES", 1), ("TURNS", 2), ("NEW_TOKENS", 4)):
        monkeypatch.setattr(rollout_demo, name, value)
    with Progress(console=Console(file=io.StringIO())) as progress:
        rows = dict(rollout_demo.demo(progress))
        assert progress.tasks[0].completed == progress.tasks[0].total == 3 * (2 + 1)
    assert rows["mean reward / failed episodes"] == "1.00 / 0"
    assert rows["episodes"].startswith("2 (1 forks, 1 prefix turns reused)")
    assert rows["report"] == str(tmp_path / "k3sys-demo-rollout.html")
    assert "e0.1" in (tmp_path / "k3sys-demo-rollout.html").read_text()
