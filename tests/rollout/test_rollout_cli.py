"""`k3sys rollout` end to end in its own process and runtime directory: tables on stdout, an HTML
report holding every episode of the run and of its "none" baseline, JSON, nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3sys.sandbox import HTTPBackend

pytestmark = pytest.mark.timeout(240)

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_cli_prints_tables_and_writes_a_report_with_every_episode(tmp_path, rt, debian, leak_check):
    """Embedded in its own runtime directory; for `rt` remote, on that service (`--api-url`)."""
    home = tmp_path / "home"
    html, js = tmp_path / "report.html", tmp_path / "report.json"
    env = {**os.environ, "K3SYS_HOME": str(home), "PYTHONPATH": SRC, "COLUMNS": "120"}
    remote = ["--api-url", rt.api_url] if isinstance(rt, HTTPBackend) else []
    if remote:
        env["K3SYS_API_KEY"] = rt.api_key
    cmd = [sys.executable, "-m", "k3sys.cli", "rollout", "--episodes", "3", "--turns", "3", "--think-ms", "200",
           "--group", "2", "--branch-at", "1", "--resident-mb", "4", "--html", str(html), "--json", str(js), *remote]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rollout totals: pause_policy=pause" in out.stdout and "none (same run)" in out.stdout
    assert f"HTML report: {html.resolve()}" in out.stdout
    data = json.loads(js.read_text())
    ids = [e["id"] for e in data["episodes"]]
    assert ids == ["e0", "e0.1", "e1", "e1.1", "e2", "e2.1"]
    assert [e["id"] for e in data["baseline"]["episodes"]] == ids
    assert data["totals"]["mean_reward"] == 1.0 and data["totals"]["forks"] == 3
    page = html.read_text()
    for run in (data, data["baseline"]):
        for e in run["episodes"]:
            assert f"<b>{e['id']}</b>" in page and e["sandbox_id"] in page
    assert page.count("data:image/png;base64,") == 3  # timelines, memory over time, baseline timelines
    assert leak_check(home) == []
    if remote:  # every sandbox of the run lived on the service, and is gone from it
        ran = {e["sandbox_id"] for run in (data, data["baseline"]) for e in run["episodes"]}
        assert not home.exists()  # no embedded runtime was opened
        assert ran and not ran & {i.id for i in rt.list()}


def test_cli_rejects_a_bad_pause_policy(tmp_path):
    env = {**os.environ, "K3SYS_HOME": str(tmp_path / "home"), "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-m", "k3sys.cli", "rollout", "--pause-policy", "sleep"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "pause_policy" in out.stdout + out.stderr
