"""`k3sys ep plan` end to end, and the CLI starting without torch."""

from __future__ import annotations

import re
import subprocess
import sys

import k3sys.ep


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3sys.cli", *args], capture_output=True, text=True, timeout=120)


def test_ep_plan_prints_every_rank_balanced():
    out = run("ep", "plan", "-R", "4", "-E", "16", "-K", "2", "-s", "128", "--maxvio", "3")
    assert out.returncode == 0, out.stderr
    assert "balancedness" in out.stdout and "-> 1.000" in out.stdout
    # every rank's row: rank, home load, cap 256 and slots 256 (128 tokens * K=2)
    assert len(re.findall(r"│\s+\d+ │\s+\d+ │\s+256 │\s+256 │", out.stdout)) == 4, out.stdout


def test_ep_plan_uneven_homes_and_bad_sizes():
    out = run("ep", "plan", "-R", "3", "-E", "16", "-K", "2", "-s", "64")  # homes 5, 5, 6
    assert out.returncode == 0, out.stderr
    assert len(re.findall(r"│\s+\d+ │\s+\d+ │\s+128 │\s+128 │", out.stdout)) == 3, out.stdout
    out = run("ep", "plan", "-R", "17", "-E", "16", "-K", "2")
    assert out.returncode != 0 and "1 <= R <= E, got R=17, E=16" in out.stderr


def test_cli_and_ep_package_import_without_torch():
    code = "import sys, k3sys.cli, k3sys.ep; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert sorted(k3sys.ep.__all__) == sorted(k3sys.ep._EXPORTS)
