"""`k3sys fleet node` / `nodes` and `k3sys rollout --fleet`, each in its own process against the test cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

pytestmark = pytest.mark.timeout(300)
SRC = str(Path(__file__).resolve().parents[2] / "src")


def k3sys(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "k3sys.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_node_joins_by_affinity_and_nodes_lists_it(cluster, fleet, tmp_path):
    from k3sys.fleet import stop_node

    address = cluster.cluster.address
    r = k3sys("fleet", "node", "--name", "extra", "--home", str(tmp_path / "extra"), "--address", address,
              "--capacity-mb", "1024")
    assert r.returncode == 0, r.stderr
    assert "node extra on" in r.stderr and "1024 MiB free" in r.stderr
    try:
        # The running gateway's fleet finds it.
        wait_until(lambda: hasattr(fleet.nodes().get("extra"), "pid"), 10, "the new node joining", step=0.1)
        r = k3sys("fleet", "nodes", "--address", address)
        assert r.returncode == 0, r.stderr
        for name in ("n0", "n1", "n2", "extra"):
            assert name in r.stdout
        again = k3sys("fleet", "node", "--name", "extra", "--home", str(tmp_path / "other"), "--address", address)
        assert again.returncode != 0  # the name is taken
        bad = k3sys("fleet", "node", "--name", "Bad Name!", "--home", str(tmp_path / "bad"), "--address", address)
        assert bad.returncode != 0 and "node name" in bad.stderr
    finally:
        stop_node("extra", kill_sandboxes=True)
    # Lost: the other tests see only n0-n2.
    wait_until(lambda: isinstance(fleet.nodes().get("extra"), str), 10, "the stopped node lost", step=0.1)


def test_rollout_cli_runs_on_the_fleet(cluster, fleet, tmp_path):
    js = tmp_path / "report.json"
    r = k3sys("rollout", "--fleet", cluster.cluster.address, "--episodes", "3", "--turns", "1", "--think-ms", "50",
              "--no-baseline", "--resident-mb", "0", "--poll-ms", "0", "--html", str(tmp_path / "r.html"),
              "--json", str(js))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(js.read_text())
    assert len(report["episodes"]) == 3 and not any(e["error"] for e in report["episodes"])
    assert not [i for i in fleet.list() if i.id in {e["sandbox_id"] for e in report["episodes"]}]
